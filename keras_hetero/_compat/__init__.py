"""The one place that knows Keras 3 from tf-keras (Keras 2), and every use
of a private TensorFlow / Keras internal (tests/project/test_structure.py checks
that no module outside `_compat/` has one).

The flavour is chosen once, at import (`flavour.py`), the way TensorFlow
chooses it: `TF_USE_LEGACY_KERAS=1` selects tf-keras, anything else Keras 3.
The overrides, each small and naming the upstream bug it works around, are
grouped by what they touch: `model`, `training`, `saving`, `callbacks`,
`data`, `distribute`. Callers use `_compat.<name>`; this module re-exports
them all.
"""

from keras_hetero._compat.callbacks import RAN_OUT_OF_DATA
from keras_hetero._compat.callbacks import backup_resume_epoch
from keras_hetero._compat.callbacks import end_epoch_before_step
from keras_hetero._compat.callbacks import restores_from_files
from keras_hetero._compat.callbacks import set_initial_step
from keras_hetero._compat.callbacks import shared_file_paths
from keras_hetero._compat.data import array_class_weights
from keras_hetero._compat.data import class_weight_map_fn
from keras_hetero._compat.data import dataset_graph
from keras_hetero._compat.data import global_shuffle
from keras_hetero._compat.data import host_variable
from keras_hetero._compat.data import inline_map
from keras_hetero._compat.data import iterators_without_autotuning
from keras_hetero._compat.data import set_steps_of_distributed_dataset
from keras_hetero._compat.data import supports_random_access
from keras_hetero._compat.data import with_known_length
from keras_hetero._compat.data import without_last_cardinality_assertion
from keras_hetero._compat.data import without_partial_batch_check
from keras_hetero._compat.distribute import configure_coordination_timeouts
from keras_hetero._compat.distribute import coordinator_workers
from keras_hetero._compat.distribute import delete_coordination_value
from keras_hetero._compat.distribute import get_coordination_value
from keras_hetero._compat.distribute import gpu_memory_limit
from keras_hetero._compat.distribute import has_coordination_value
from keras_hetero._compat.distribute import in_multi_worker_mode
from keras_hetero._compat.distribute import local_collective_strategy
from keras_hetero._compat.distribute import mirrored_strategy
from keras_hetero._compat.distribute import parameter_server_num_workers
from keras_hetero._compat.distribute import per_worker_values
from keras_hetero._compat.distribute import set_coordination_value
from keras_hetero._compat.flavour import CONVERTS_OPTIONAL_INPUTS
from keras_hetero._compat.flavour import EPOCH_ITERATOR_YIELDS_STEP_RANGE
from keras_hetero._compat.flavour import FLAVOUR
from keras_hetero._compat.flavour import IS_LEGACY
from keras_hetero._compat.flavour import KERAS_RELEASE
from keras_hetero._compat.flavour import KERAS_VERSION
from keras_hetero._compat.flavour import REPEATS_DISTRIBUTED_INPUT
from keras_hetero._compat.flavour import TF_RELEASE
from keras_hetero._compat.flavour import Functional
from keras_hetero._compat.flavour import functional_init_arguments
from keras_hetero._compat.flavour import keras
from keras_hetero._compat.flavour import release
from keras_hetero._compat.flavour import unpack_x_y_sample_weight
from keras_hetero._compat.model import all_layers
from keras_hetero._compat.model import build_optimizer
from keras_hetero._compat.model import compile_arguments
from keras_hetero._compat.model import derive_from_functional
from keras_hetero._compat.model import fix_synchronized_batch_norm
from keras_hetero._compat.model import functional_config
from keras_hetero._compat.model import inbound_nodes
from keras_hetero._compat.model import init_functional
from keras_hetero._compat.model import jit_compiled
from keras_hetero._compat.model import model_strategy
from keras_hetero._compat.model import one_batch_outputs
from keras_hetero._compat.model import one_batch_per_call
from keras_hetero._compat.model import reduce_logs_to_first_replica
from keras_hetero._compat.model import register_plain_name
from keras_hetero._compat.model import register_serializable
from keras_hetero._compat.model import steps_per_execution
from keras_hetero._compat.model import symbolic_inputs_outputs
from keras_hetero._compat.saving import checkpoint_variables
from keras_hetero._compat.saving import random_generator_states
from keras_hetero._compat.saving import unsaved_random_layers
from keras_hetero._compat.training import Keras3TrainerOverrides
from keras_hetero._compat.training import TrainerOverrides
from keras_hetero._compat.training import apply_aggregated_gradients
from keras_hetero._compat.training import atomic_variable_updates
from keras_hetero._compat.training import autoconvert_optionals
from keras_hetero._compat.training import distributed_variable
from keras_hetero._compat.training import first_local_values
from keras_hetero._compat.training import global_metrics_result
from keras_hetero._compat.training import has_learning_rate_schedule
from keras_hetero._compat.training import is_keras_optimizer
from keras_hetero._compat.training import is_loss_scale_optimizer
from keras_hetero._compat.training import local_metric_values
from keras_hetero._compat.training import local_metrics_result
from keras_hetero._compat.training import metrics_result_from
from keras_hetero._compat.training import optimizer_variables
from keras_hetero._compat.training import set_element_spec
from keras_hetero._compat.training import skip_optimizer_all_reduce
from keras_hetero._compat.training import unordered_timestamp
from keras_hetero._compat.training import unscaled_mean_loss
from keras_hetero._compat.training import update_metrics

__all__ = [
    "RAN_OUT_OF_DATA",
    "backup_resume_epoch",
    "end_epoch_before_step",
    "restores_from_files",
    "set_initial_step",
    "shared_file_paths",
    "array_class_weights",
    "class_weight_map_fn",
    "dataset_graph",
    "global_shuffle",
    "host_variable",
    "inline_map",
    "iterators_without_autotuning",
    "set_steps_of_distributed_dataset",
    "supports_random_access",
    "with_known_length",
    "without_last_cardinality_assertion",
    "without_partial_batch_check",
    "configure_coordination_timeouts",
    "coordinator_workers",
    "delete_coordination_value",
    "get_coordination_value",
    "gpu_memory_limit",
    "has_coordination_value",
    "in_multi_worker_mode",
    "local_collective_strategy",
    "mirrored_strategy",
    "parameter_server_num_workers",
    "per_worker_values",
    "set_coordination_value",
    "CONVERTS_OPTIONAL_INPUTS",
    "EPOCH_ITERATOR_YIELDS_STEP_RANGE",
    "FLAVOUR",
    "IS_LEGACY",
    "KERAS_RELEASE",
    "KERAS_VERSION",
    "REPEATS_DISTRIBUTED_INPUT",
    "TF_RELEASE",
    "Functional",
    "functional_init_arguments",
    "keras",
    "release",
    "unpack_x_y_sample_weight",
    "all_layers",
    "build_optimizer",
    "compile_arguments",
    "derive_from_functional",
    "fix_synchronized_batch_norm",
    "functional_config",
    "inbound_nodes",
    "init_functional",
    "jit_compiled",
    "model_strategy",
    "one_batch_outputs",
    "one_batch_per_call",
    "reduce_logs_to_first_replica",
    "register_plain_name",
    "register_serializable",
    "steps_per_execution",
    "symbolic_inputs_outputs",
    "checkpoint_variables",
    "random_generator_states",
    "unsaved_random_layers",
    "Keras3TrainerOverrides",
    "TrainerOverrides",
    "apply_aggregated_gradients",
    "atomic_variable_updates",
    "autoconvert_optionals",
    "distributed_variable",
    "first_local_values",
    "global_metrics_result",
    "has_learning_rate_schedule",
    "is_keras_optimizer",
    "is_loss_scale_optimizer",
    "local_metric_values",
    "local_metrics_result",
    "metrics_result_from",
    "optimizer_variables",
    "set_element_spec",
    "skip_optimizer_all_reduce",
    "unordered_timestamp",
    "unscaled_mean_loss",
    "update_metrics",
]
