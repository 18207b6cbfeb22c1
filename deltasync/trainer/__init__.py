"""The trainer side: find which bf16 weights changed and publish them into a bucket.

- :mod:`.detector`: :class:`~.detector.BF16ChangeDetector`, the exact change finder, and
  :mod:`.scan`, its compare (on the host in chunks, on accelerators in slices);
- :mod:`.sources`: where weights come from (a model, an adapter, merged LoRA);
- :mod:`.publisher`: :class:`~.publisher.DeltaPublisher`, the writer of versions, through its
  parts :mod:`.capture`, :mod:`.writer`, :mod:`.anchors`, :mod:`.retention` and
  :mod:`.view_publishing`;
- :mod:`.sharded`: several trainer processes (FSDP2, HSDP, DDP);
- :mod:`.checkpoint_layout`: live parameters in checkpoint layout;
- :mod:`.view_chain`: the quantized views beside the bf16 chain; :mod:`.view_targets`: which
  weights of a model a scheme quantizes;
- :mod:`.lora`: adapters and merged LoRA.

Rollout servers never import this package (tests/unit/test_imports.py checks it).
"""
