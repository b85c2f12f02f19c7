"""Reference models: ``cifar_cnn``, ``mlp``, ``digits_cnn``, ``rnn_lm``, ``transformer_lm``; and the registry
that builds them by name."""

from polytrain.models.cifar_cnn import cifar_cnn
from polytrain.models.digits_cnn import digits_cnn
from polytrain.models.mlp import mlp
from polytrain.models.registry import available_models, build_model, register_model
from polytrain.models.rnn_lm import rnn_lm
from polytrain.models.transformer_lm import transformer_lm

__all__ = ["available_models", "build_model", "cifar_cnn", "digits_cnn", "mlp", "register_model", "rnn_lm",
           "transformer_lm"]
