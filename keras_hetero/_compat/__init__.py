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

from keras_hetero._compat.callbacks import RAN_OUT_OF_DATA as RAN_OUT_OF_DATA
from keras_hetero._compat.callbacks import (
    backup_resume_epoch as backup_resume_epoch,
)
from keras_hetero._compat.callbacks import (
    end_epoch_before_step as end_epoch_before_step,
)
from keras_hetero._compat.callbacks import (
    restores_from_files as restores_from_files,
)
from keras_hetero._compat.callbacks import set_initial_step as set_initial_step
from keras_hetero._compat.callbacks import (
    shared_file_paths as shared_file_paths,
)
from keras_hetero._compat.data import array_class_weights as array_class_weights
from keras_hetero._compat.data import class_weight_map_fn as class_weight_map_fn
from keras_hetero._compat.data import dataset_graph as dataset_graph
from keras_hetero._compat.data import global_shuffle as global_shuffle
from keras_hetero._compat.data import host_variable as host_variable
from keras_hetero._compat.data import inline_map as inline_map
from keras_hetero._compat.data import (
    iterators_without_autotuning as iterators_without_autotuning,
)
from keras_hetero._compat.data import (
    set_steps_of_distributed_dataset as set_steps_of_distributed_dataset,
)
from keras_hetero._compat.data import (
    supports_random_access as supports_random_access,
)
from keras_hetero._compat.data import with_known_length as with_known_length
from keras_hetero._compat.data import (
    without_partial_batch_check as without_partial_batch_check,
)
from keras_hetero._compat.distribute import (
    configure_coordination_timeouts as configure_coordination_timeouts,
)
from keras_hetero._compat.distribute import (
    coordinator_workers as coordinator_workers,
)
from keras_hetero._compat.distribute import (
    delete_coordination_value as delete_coordination_value,
)
from keras_hetero._compat.distribute import (
    get_coordination_value as get_coordination_value,
)
from keras_hetero._compat.distribute import gpu_memory_limit as gpu_memory_limit
from keras_hetero._compat.distribute import (
    has_coordination_value as has_coordination_value,
)
from keras_hetero._compat.distribute import (
    in_multi_worker_mode as in_multi_worker_mode,
)
from keras_hetero._compat.distribute import (
    local_collective_strategy as local_collective_strategy,
)
from keras_hetero._compat.distribute import (
    mirrored_strategy as mirrored_strategy,
)
from keras_hetero._compat.distribute import (
    parameter_server_num_workers as parameter_server_num_workers,
)
from keras_hetero._compat.distribute import (
    per_worker_values as per_worker_values,
)
from keras_hetero._compat.distribute import (
    set_coordination_value as set_coordination_value,
)
from keras_hetero._compat.flavour import (
    CONVERTS_OPTIONAL_INPUTS as CONVERTS_OPTIONAL_INPUTS,
)
from keras_hetero._compat.flavour import (
    EPOCH_ITERATOR_YIELDS_STEP_RANGE as EPOCH_ITERATOR_YIELDS_STEP_RANGE,
)
from keras_hetero._compat.flavour import FLAVOUR as FLAVOUR
from keras_hetero._compat.flavour import IS_LEGACY as IS_LEGACY
from keras_hetero._compat.flavour import KERAS_RELEASE as KERAS_RELEASE
from keras_hetero._compat.flavour import KERAS_VERSION as KERAS_VERSION
from keras_hetero._compat.flavour import (
    REPEATS_DISTRIBUTED_INPUT as REPEATS_DISTRIBUTED_INPUT,
)
from keras_hetero._compat.flavour import TF_RELEASE as TF_RELEASE
from keras_hetero._compat.flavour import Functional as Functional
from keras_hetero._compat.flavour import (
    functional_init_arguments as functional_init_arguments,
)
from keras_hetero._compat.flavour import keras as keras
from keras_hetero._compat.flavour import release as release
from keras_hetero._compat.flavour import (
    unpack_x_y_sample_weight as unpack_x_y_sample_weight,
)
from keras_hetero._compat.model import all_layers as all_layers
from keras_hetero._compat.model import build_optimizer as build_optimizer
from keras_hetero._compat.model import compile_arguments as compile_arguments
from keras_hetero._compat.model import (
    derive_from_functional as derive_from_functional,
)
from keras_hetero._compat.model import (
    fix_synchronized_batch_norm as fix_synchronized_batch_norm,
)
from keras_hetero._compat.model import functional_config as functional_config
from keras_hetero._compat.model import inbound_nodes as inbound_nodes
from keras_hetero._compat.model import init_functional as init_functional
from keras_hetero._compat.model import jit_compiled as jit_compiled
from keras_hetero._compat.model import model_strategy as model_strategy
from keras_hetero._compat.model import one_batch_outputs as one_batch_outputs
from keras_hetero._compat.model import one_batch_per_call as one_batch_per_call
from keras_hetero._compat.model import (
    reduce_logs_to_first_replica as reduce_logs_to_first_replica,
)
from keras_hetero._compat.model import (
    register_plain_name as register_plain_name,
)
from keras_hetero._compat.model import (
    register_serializable as register_serializable,
)
from keras_hetero._compat.model import (
    steps_per_execution as steps_per_execution,
)
from keras_hetero._compat.model import (
    symbolic_inputs_outputs as symbolic_inputs_outputs,
)
from keras_hetero._compat.saving import (
    checkpoint_variables as checkpoint_variables,
)
from keras_hetero._compat.saving import (
    random_generator_states as random_generator_states,
)
from keras_hetero._compat.saving import (
    unsaved_random_layers as unsaved_random_layers,
)
from keras_hetero._compat.training import (
    Keras3TrainerOverrides as Keras3TrainerOverrides,
)
from keras_hetero._compat.training import TrainerOverrides as TrainerOverrides
from keras_hetero._compat.training import (
    apply_aggregated_gradients as apply_aggregated_gradients,
)
from keras_hetero._compat.training import (
    atomic_variable_updates as atomic_variable_updates,
)
from keras_hetero._compat.training import (
    autoconvert_optionals as autoconvert_optionals,
)
from keras_hetero._compat.training import (
    distributed_variable as distributed_variable,
)
from keras_hetero._compat.training import (
    first_local_values as first_local_values,
)
from keras_hetero._compat.training import (
    global_metrics_result as global_metrics_result,
)
from keras_hetero._compat.training import (
    has_learning_rate_schedule as has_learning_rate_schedule,
)
from keras_hetero._compat.training import (
    is_keras_optimizer as is_keras_optimizer,
)
from keras_hetero._compat.training import (
    is_loss_scale_optimizer as is_loss_scale_optimizer,
)
from keras_hetero._compat.training import (
    local_metric_values as local_metric_values,
)
from keras_hetero._compat.training import (
    local_metrics_result as local_metrics_result,
)
from keras_hetero._compat.training import (
    metrics_result_from as metrics_result_from,
)
from keras_hetero._compat.training import (
    optimizer_variables as optimizer_variables,
)
from keras_hetero._compat.training import set_element_spec as set_element_spec
from keras_hetero._compat.training import (
    skip_optimizer_all_reduce as skip_optimizer_all_reduce,
)
from keras_hetero._compat.training import (
    unordered_timestamp as unordered_timestamp,
)
from keras_hetero._compat.training import (
    unscaled_mean_loss as unscaled_mean_loss,
)
from keras_hetero._compat.training import update_metrics as update_metrics
