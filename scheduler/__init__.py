"""stepserve's continuous-batching scheduler: pure Python, no torch, no asyncio."""

from scheduler.config import SchedulerConfig
from scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.request import Request, RequestStatus
from scheduler.sampling import SamplingParams, SamplingParamsError
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats

__all__ = [
    "CachedRequestData", "ModelRunnerOutput", "NewRequestData", "Request", "RequestOutput",
    "RequestStatus", "SamplingParams", "SamplingParamsError", "Scheduler", "SchedulerConfig",
    "SchedulerOutput", "SchedulerStats", "TokenLogprobs",
]
