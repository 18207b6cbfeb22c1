"""The trainer's side of the control plane: telling rollout servers that a version is ready.

- :mod:`.client`: :class:`~.client.RolloutClient`, one small HTTP request per server;
- :mod:`.serve`: ``deltasync serve``, a vLLM server's command line following a bucket.

The routes and messages both sides speak are in :mod:`deltasync.protocol`.
"""
