"""The callback protocol under its former path; it lives in
`keras_hetero/_callback_protocol.py`.

Importing this module runs `keras_hetero/callbacks/__init__.py`, which
imports every callback: modules below the callbacks import
`keras_hetero._callback_protocol` instead.
"""

from keras_hetero._callback_protocol import STAGES as STAGES
from keras_hetero._callback_protocol import FitContext as FitContext
from keras_hetero._callback_protocol import HeteroCallback as HeteroCallback
from keras_hetero._callback_protocol import observers_last as observers_last
from keras_hetero._callback_protocol import prepare_fit as prepare_fit
