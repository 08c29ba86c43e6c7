"""The time budget in the simulator: the scheduler's online step-cost model, seeded and fed
from the simulator's own cost model (its sweep's plot is `loadgen.sim.plots.plot_budget_vs_target`).

The scheduler in the simulator gets exactly what the server's gets: an
`OnlineStepCost`, seeded with the start-up calibration's shapes (priced here by the
`CostModel` instead of measured by a worker) and refitted after every simulated step from
the time the virtual clock advanced. So the simulated time budget includes the fit's lag
and its error on shapes the calibration did not cover, as the live one does.
"""

from __future__ import annotations

from loadgen.sim.cost_model import CostModel
from scheduler.step_cost_calibration import calibration_steps
from scheduler.step_cost_fit import OnlineStepCost

_LARGE = 1 << 30


def seeded_model(cm: CostModel) -> OnlineStepCost:
    """A fresh model seeded with the calibration shapes, priced by `cm`."""
    model = OnlineStepCost(block_bytes=cm.shape.kv_bytes_per_token * cm.block_size,
                           copy_bandwidth=cm.hardware.host_bandwidth)
    for step in calibration_steps(cm.block_size, _LARGE, _LARGE, cm.shape.vocab_size):
        if step.measured:
            model.seed(step.shape, cm.step_time(step.shape))
    return model
