"""The job function's import path before the job service was split into
:mod:`digen.runtime.jobs` (submit, status, logs, cancel) and :mod:`digen.runtime.runner`
(``digen serve``): jobs queued by an older digen name ``digen.runtime.service.execute_job``."""

from digen.runtime.runner import execute_job

__all__ = ["execute_job"]
