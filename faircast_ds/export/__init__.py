"""Shipping the served weights: the served-weight source, HF export, weight sync.

- :class:`ServedSource` is the one served-weight source every consumer reads: walks that yield each
  parameter's served bf16 bits once (dense) or only the parameters changed since the last
  acknowledged version (delta), with one :class:`ServedReport` type for every consumer.
  :func:`served_weights` is its per-parameter primitive (a collective under ZeRO-3);
  :func:`served_specs` lists names, shapes and dtypes without gathering. Each reads the model
  through the reader its integration handed over (:func:`provide`, :func:`reader_of`; a model no
  integration attached is read as a plain module).
- :func:`save_hf` writes a Hugging Face directory (safetensors + config) atomically.
- :class:`WeightSender` / :class:`WeightReceiver` push the weights to a separate inference process
  over an authenticated TCP channel of their own, dense or as sparse deltas, all-or-nothing (the
  channel's errors: :class:`WeightSyncError` and its kinds).
- :class:`ParamSpec`, :class:`AtomicDirectory`: a served parameter's name, shape and dtype; a directory
  written whole or not at all.

The pieces the push into ``vllm serve`` shares with its engine (the data plane's layout and ledger,
``plane``; the send group, ``send_group``; delta encodings, ``delta``) are
modules here, not names of this face: their user is :mod:`faircast_ds.vllm.transfer`. A checkpoint's or an
export's summary (``faircast-ds inspect``) is :mod:`faircast_ds.tools.inspect`.
"""
from __future__ import annotations

from faircast_ds.export.atomic import AtomicDirectory
from faircast_ds.export.channel import (
                                        DEFAULT_HOST,
                                        AcceptTimeout,
                                        AuthenticationError,
                                        ChannelError,
                                        ProtocolError,
                                        Refused,
                                        WeightSyncError,
)
from faircast_ds.export.hf import ExportError, ExportResult, save_hf
from faircast_ds.export.served import ParamSpec
from faircast_ds.export.source import (
                                        ModelReader,
                                        ServedItem,
                                        ServedReader,
                                        ServedReport,
                                        ServedSource,
                                        Walk,
                                        local_served_slices,
                                        provide,
                                        reader_of,
                                        served_specs,
                                        served_weights,
)
from faircast_ds.export.sync import (
                                        SyncAborted,
                                        WeightReceiver,
                                        WeightSender,
)

__all__ = ["AcceptTimeout", "AtomicDirectory", "AuthenticationError", "ChannelError", "ProtocolError", "Refused", "DEFAULT_HOST", "ExportError", "ExportResult", "ModelReader", "ParamSpec", "ServedItem",
           "ServedReader", "ServedReport", "ServedSource", "Walk",
           "SyncAborted", "WeightReceiver", "WeightSender", "WeightSyncError", "local_served_slices",
           "provide", "reader_of", "save_hf", "served_specs", "served_weights"]
