"""Cluster placement: the Dask side of a run. Start or join a cluster
(:mod:`~digen.cluster.cluster`), start a worker node that carries a role and a GPU type
(:mod:`~digen.cluster.node`), give each worker process its GPU (:mod:`~digen.cluster.placement`),
and the cluster's own certificate authority for mutual TLS (:mod:`~digen.cluster.certs`).
"""
