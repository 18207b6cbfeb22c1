"""The trainer's side of the control plane: telling rollout servers that a version is ready.

- :mod:`.client`: :class:`~.client.RolloutClient`, one small HTTP request per server
  (:mod:`.http`: the calls to one server; :mod:`.vllm_routes`: vLLM's own update routes, for a
  server without ``vllm_ext``'s);
- :mod:`.lora_client`: :class:`~.lora_client.AdapterRolloutClient`, the same for adapter versions;
- :mod:`.serve`: ``deltasync serve``, a vLLM server's command line following a bucket.

The routes and messages both sides speak are in :mod:`deltasync.protocol`.
"""
