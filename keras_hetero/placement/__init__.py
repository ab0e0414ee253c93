"""`plan`: split a chain of layers into stages on (unequal) devices.

Each top-level layer gets a cost (seconds of forward + backward work on a
speed-1.0 device for one batch), a memory need and the bytes of its output
activations. A stage is a contiguous run of layers on one device; its time is
its cost divided by the device's speed plus the time to receive its input
activations. The planner picks which devices take stages, in which order,
and the split points, so that the slowest stage (the pipeline's bottleneck)
is as fast as possible and every stage fits its device's memory.
`plan_layout` compares that pipeline with data parallelism and with one
pipeline per worker.

The modules: `costs` (each layer's seconds and bytes, each device's speed
and memory: given, measured or estimated), `search` (the exact dynamic
programs and the local search; pure Python, testable without TensorFlow),
`planner` (`plan`, `Plan`), `layout` (`plan_layout`) and `profiling`
(`profile`: the costs, speeds and memory measured on the devices
themselves).
"""

from keras_hetero.layers import chain_layers
from keras_hetero.placement.costs import DEFAULT_BANDWIDTH
from keras_hetero.placement.costs import DEFAULT_FLOPS_PER_SECOND
from keras_hetero.placement.costs import PARAMETER_COPIES
from keras_hetero.placement.costs import TRAINING_FLOP_FACTOR
from keras_hetero.placement.layout import CROSS_WORKER_PIPELINE
from keras_hetero.placement.layout import DATA_PARALLEL
from keras_hetero.placement.layout import DEFAULT_NETWORK_BANDWIDTH
from keras_hetero.placement.layout import PIPELINE
from keras_hetero.placement.layout import REPLICATED_PIPELINES
from keras_hetero.placement.layout import Device
from keras_hetero.placement.layout import Layout
from keras_hetero.placement.layout import LayoutChoice
from keras_hetero.placement.layout import pipeline_seconds
from keras_hetero.placement.layout import plan_layout
from keras_hetero.placement.planner import Plan
from keras_hetero.placement.planner import Stage
from keras_hetero.placement.planner import plan
from keras_hetero.placement.profiling import Profile
from keras_hetero.placement.profiling import profile
from keras_hetero.placement.search import partition

# The documented API (docs/api.md): the planner, the cost model's defaults,
# `Layout.kind`'s values, the fixed-order split, and the chain of layers a
# plan covers.
__all__ = [
    "Device",
    "Layout",
    "LayoutChoice",
    "Plan",
    "Profile",
    "Stage",
    "pipeline_seconds",
    "plan",
    "plan_layout",
    "profile",
    "chain_layers",
    "DEFAULT_BANDWIDTH",
    "DEFAULT_FLOPS_PER_SECOND",
    "PARAMETER_COPIES",
    "TRAINING_FLOP_FACTOR",
    "CROSS_WORKER_PIPELINE",
    "DATA_PARALLEL",
    "DEFAULT_NETWORK_BANDWIDTH",
    "PIPELINE",
    "REPLICATED_PIPELINES",
    "partition",
]
