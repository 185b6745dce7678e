"""The attention interface: the step's batch metadata, per-layer caches and per-step memos that models,
kernels (``metal_kernels``, ``cpu_kernels``), the engine and convert share. A leaf: it imports none of
them (``cpu_kernels`` only for the native KV write)."""
