"""The virtual-clock simulator: the real `Scheduler` driven by a step-time cost model.

Imports `scheduler/` and `loadgen`'s workloads and reports, never `service/` or `worker/`.
"""
