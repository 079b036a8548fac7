"""checkpoint: TF object-graph checkpoints for varstate pytrees."""

__all__: list[str] = []
