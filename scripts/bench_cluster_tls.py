"""What the embedded cluster's TLS costs (docs/benchmarks.md, "The embedded cluster's TLS").

Paired rounds, plain and TLS in alternating order: the job's TLS files made
(:class:`digen.cluster.certs.JobCerts`), the local cluster of the quickstart's shape started
until its workers have joined (:func:`digen.cluster.cluster.start_local_cluster`, forkserver,
1 rollout + 1 trainer), one ``client.run`` on every worker, and one blob of ``--mib`` MiB
fetched from a blob server in this process, plain and over mutual TLS with the same files.
The first pair warms the fork server and is reported apart. Prints one Markdown table::

    PYTHONPATH=$PWD python scripts/bench_cluster_tls.py [--rounds 4] [--mib 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def cluster_start(security) -> tuple[float, float]:
    """(seconds to a started cluster with both workers, seconds of one run on every worker)."""
    from digen.cluster.cluster import close_local_cluster, start_local_cluster

    t0 = time.perf_counter()
    cluster, client = start_local_cluster(1, 1, "cpu", 1, start_method="forkserver", security=security)
    started = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        client.run(os.getpid)
        ran = time.perf_counter() - t1
    finally:
        client.close()
        close_local_cluster(cluster)
    return started, ran


def blob_fetch(files: tuple[str, str, str] | None, mib: int) -> float:
    """Seconds to fetch one blob of ``mib`` MiB (float32) from a server in this process."""
    import torch

    from digen.dataplane.auth import keyring, new_key
    from digen.dataplane.blobs import BlobServer, BlobStore, connection, fetch, tls_contexts

    keyring().add("bench", new_key())
    store = BlobStore(producer="bench")
    store.put("bench:weights:1", {"w": torch.ones(mib * 2**18)})
    _ = store.get("bench:weights:1").digest  # hashed once, before the clock
    server_ctx, client_ctx = tls_contexts(*files) if files else (None, None)
    server = BlobServer(store, ssl_context=server_ctx)
    try:
        with connection(server.address, client_ctx) as ch:
            t0 = time.perf_counter()
            fetch(server.address, "bench:weights:1", sock=ch)
            return time.perf_counter() - t0
    finally:
        server.close()
        keyring().drop("bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()

    from digen.cluster.certs import JobCerts
    from digen.cluster.node import dask_security

    rows: dict[str, list[float]] = {k: [] for k in ("certs", "plain", "tls", "run plain", "run tls")}
    fetches: dict[str, list[float]] = {"plain": [], "tls": []}
    warm = None
    for i in range(args.rounds + 1):
        t0 = time.perf_counter()
        certs = JobCerts.make()
        made = time.perf_counter() - t0
        try:
            order = ("plain", "tls") if i % 2 == 0 else ("tls", "plain")
            got, fetched = {}, {}
            for kind in order:
                got[kind] = cluster_start(dask_security(certs.security()) if kind == "tls" else None)
                fetched[kind] = blob_fetch(certs.files if kind == "tls" else None, args.mib)
        finally:
            certs.remove()
        if i == 0:
            warm = got
            continue
        rows["certs"].append(made)
        for kind in ("plain", "tls"):
            fetches[kind].append(fetched[kind])
            rows[kind].append(got[kind][0])
            rows[f"run {kind}"].append(got[kind][1])

    def cell(xs: list[float], scale: float = 1.0, unit: str = "s") -> str:
        return f"{statistics.median(xs) * scale:.3g} {unit} ({', '.join(f'{x * scale:.3g}' for x in xs)})"

    print("| what | plain | TLS (job's own CA) |")
    print("|---|---|---|")
    print(f"| job's TLS files made (JobCerts.make) | - | {cell(rows['certs'], 1000, 'ms')} |")
    print(
        f"| cluster start, 1 rollout + 1 trainer, forkserver | {cell(rows['plain'])} | {cell(rows['tls'])} |"
    )
    print(
        f"| one client.run on both workers | {cell(rows['run plain'], 1000, 'ms')} | {cell(rows['run tls'], 1000, 'ms')} |"
    )
    mib = args.mib
    tput = {k: [mib / x for x in v] for k, v in fetches.items()}
    print(
        f"| one {mib} MiB blob fetch, loopback (MiB/s) | {cell(tput['plain'], 1, 'MiB/s')} | {cell(tput['tls'], 1, 'MiB/s')} |"
    )
    if warm:
        print(
            f"\nwarm-up pair (fork server start included): plain {warm['plain'][0]:.2f} s, TLS {warm['tls'][0]:.2f} s"
        )
    print(f"rounds: {args.rounds} (medians, then each round); load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
