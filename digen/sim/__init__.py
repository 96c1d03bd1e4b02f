"""The simulator: the real :class:`~digen.core.scheduler.Scheduler` driven by a cost model.

- :mod:`digen.sim.costmodel` per-task seconds (paper scale from FLOPs, bytes and bandwidths);
- :mod:`digen.sim.dataplane` the data plane's seconds (all-reduce, AdamW, weight distribution,
  trajectory transfer), calibrated by ``digen bench --dataplane``;
- :mod:`digen.sim.catalog` ``configs/sim/*.yaml`` (GPU types, models, workloads, testbeds);
- :mod:`digen.sim.driver` the discrete-event driver and the modes (colocated, disaggregated,
  the ablation ladder, digen);
- :mod:`digen.sim.study` split search and per-mode comparison with colocated and the bound;
- :mod:`digen.sim.bounds` zero-bubble and LP bounds;
- :mod:`digen.sim.report` tables, Markdown and the Gantt chart;
- :mod:`digen.sim.calibrate` a cost model measured from a real run, prediction vs measurement;
- :mod:`digen.sim.sp_calibration` sequence-parallel efficiency measured (a run, or :mod:`digen.sim.sp_bench`);
- :mod:`digen.sim.rundata` a run directory as both read it.

``import digen.sim`` stays light (no torch, dask, redis); matplotlib loads only to draw.
"""
