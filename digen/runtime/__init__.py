"""A run on the cluster: the controller (:mod:`~digen.runtime.controller`) and its parts, which
carry out the pure scheduler's instructions (:mod:`digen.core.scheduler`) through the control
plane (:mod:`digen.controlplane`) on the workers that cluster placement started
(:mod:`digen.cluster`)."""
