"""The engine-neutral server core: what a server that follows a bucket runs, whatever its engine.

It imports no engine; an engine plugs in through the two seams of :mod:`.seam`:
:class:`~.seam.Engine` (the API-server side: run calls on the workers, pause, resume, label) and
:class:`~.seam.Worker` (each worker process: ranks, live parameters, reload, checkpoint,
platform checks). vLLM's adapter is the ``vllm_ext`` package.

- the API-server side: :mod:`.update_route` (``/deltasync/update``, ``/deltasync/status``, the
  version headers) over :mod:`.server_sync`, :mod:`.flow` (one update), :mod:`.follower`
  (follow mode), :mod:`.token_versions`, :mod:`.metrics`; :mod:`.middleware` (the token on an
  engine's control routes) and :mod:`.asgi`; :mod:`.adapter_messages` (LoRA adapters' answers);
- the worker side: :mod:`.updater` (one worker's update) over two targets (:mod:`.target`):
  :mod:`.live_target` (deltas written in place, :mod:`.inplace`, :mod:`.weight_map`,
  :mod:`.live_flat`) and :mod:`.reload_target` (a host copy and the engine's reload,
  :mod:`.groups`); :mod:`.checkpoint` (the served checkpoint), :mod:`.cpus` (where background
  threads run), :mod:`.config` (the ``DELTASYNC_*`` environment).
"""
