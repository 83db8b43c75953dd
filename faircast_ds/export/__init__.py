"""Shipping the served weights: the served-weight source, HF export, weight sync.

- :class:`ServedSource` is the one served-weight source every consumer reads: walks that yield each
  parameter's served bf16 bits once (dense) or only the parameters changed since the last
  acknowledged version (delta), with one :class:`ServedReport` type for every consumer.
  :func:`served_weights` is its per-parameter primitive (a collective under ZeRO-3);
  :func:`served_specs` lists names, shapes and dtypes without gathering. Each reads the model
  through the reader its integration handed over (``source.provide``, ``source.reader_of``; a model no
  integration attached is read as a plain module).
- :func:`save_hf` writes a Hugging Face directory (safetensors + config) atomically.
- :class:`WeightSender` / :class:`WeightReceiver` push the weights to a separate inference process
  over an authenticated TCP channel of their own, dense or as sparse deltas, all-or-nothing (the
  channel's errors: :class:`WeightSyncError`, the base of every kind in ``channel``).

These nine names are the face a user needs. What an integration or the push builds on is in the modules,
not on this face: the readers an integration hands over (``source``: ``provide``, ``reader_of``,
``ServedReader``, ``ModelReader``), a parameter's name, shape and dtype (``served.ParamSpec``), a directory
written whole or not at all (``atomic.AtomicDirectory``), the channel's kinds of error (``channel``), and
the pieces the push into ``vllm serve`` shares with its engine (the data plane's layout and ledger,
``plane``; the send group, ``send_group``; delta encodings, ``delta``), whose user is
:mod:`faircast_ds.vllm.transfer`. A checkpoint's or an
export's summary (``faircast-ds inspect``) is :mod:`faircast_ds.tools.inspect`.
"""
from __future__ import annotations

from faircast_ds.export.channel import WeightSyncError
from faircast_ds.export.hf import ExportError, save_hf
from faircast_ds.export.source import ServedReport, ServedSource, served_specs, served_weights
from faircast_ds.export.sync import WeightReceiver, WeightSender

__all__ = ["ExportError", "ServedReport", "ServedSource", "WeightReceiver", "WeightSender", "WeightSyncError",
           "save_hf", "served_specs", "served_weights"]
