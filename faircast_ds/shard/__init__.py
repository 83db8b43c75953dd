"""One rank's shard, framework-neutral: the caster that writes every served bit (``caster``), the
adapter protocol an integration fills (``adapter``), the one handle and attach pipeline (``handle``,
``routes``), the run-time guard (``guard``),
diagnostics (``diagnostics``) and Fair Cast's checkpoint state (``state``). Never imports DeepSpeed,
Megatron or their integrations."""
