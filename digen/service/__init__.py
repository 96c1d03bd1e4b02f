"""The job service: ``digen submit``, ``status``, ``logs`` and ``cancel`` (:mod:`~digen.service.jobs`,
the client side) and ``digen serve`` (:mod:`~digen.service.runner`, an rq worker that runs each
queued job through the engine). It sits above the engine and knows nothing of a run's insides.
"""
