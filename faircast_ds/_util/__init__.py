"""Small utilities every layer may use: ranks and agreement without a collective (``dist``), and the
packages' lazy public names (``lazy``). Nothing here imports torch at import time or any other part
of faircast_ds."""
