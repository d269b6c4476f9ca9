"""Making one rank's failure every rank's clear error, in bounded time: the overview, and where
each name of the failure handling lives (import it from its module, listed below).

Three mechanisms, all through the job's key-value store (the ``TCPStore`` every
``torch.distributed`` job already has), none adding a collective to the step:

* **The failure board** (:mod:`~lightning_pp.runtime.failure.board`). A rank whose step fails writes one
  line describing itself (rank, pp/dp/ep coordinates, action, microbatch, virtual stage, the
  error) before it raises; the first writer wins. Peers then fail in their own communication (a
  closed connection or a timeout) and read the line, so every rank's error names the rank that
  failed first, not its neighbour.
* **Published positions** (:mod:`~lightning_pp.runtime.failure.watchdog`, read by
  :mod:`~lightning_pp.runtime.failure.diagnosis`). A rank that is SIGKILLed, or stuck, writes nothing. So
  every rank's watchdog thread publishes where the rank is, and a rank whose wait failed with
  nothing on the board names the peer that went away, or follows the "waiting for" chain to the
  rank that is stuck.
* **The watchdog's last resort** (:mod:`~lightning_pp.runtime.failure.watchdog`). Once a failure is on
  the board, a rank whose main thread has not raised within ``exit_grace`` seconds (blocked in a
  wait Python cannot interrupt, or stuck in computation) is ended with exit code
  :data:`WATCHDOG_EXIT_CODE`, after printing the failure and its threads' stacks.

Where the code is:

* :mod:`~lightning_pp.runtime.failure.errors`: the exceptions (:class:`PipelineError`,
  :class:`PipelineCommError`, :class:`BatchMismatchError`, :class:`NonFiniteError`),
  :func:`classify`, :func:`add_note`.
* :mod:`~lightning_pp.runtime.failure.board`: :class:`FailureBoard`, :class:`Position`.
* :mod:`~lightning_pp.runtime.failure.watchdog`: :class:`WatchdogConfig`, :class:`Watchdog`,
  :func:`watchdog_for`, :func:`current_watchdog`, :func:`main_thread_exception`.
* :mod:`~lightning_pp.runtime.failure.diagnosis`: :class:`Diagnosis`.
* :mod:`~lightning_pp.runtime.failure.outside_step`: failures outside the pipeline step
  (:func:`explain_exception`, :func:`install_excepthook`, :func:`locate`, :func:`summarize`,
  :func:`is_comm_error`, :func:`reported_by_executor`).
"""
