"""Dynamic-model traces from trained state: SmolLM2-135M offline, one recorder per case (issue 20).

Read in this order: :mod:`.smollm` (the pretrained model and a tiny stand-in), :mod:`.text` (the embedded
corpus as SmolLM2 tokens), :mod:`.traces` (the trace file and its min/median/max summary),
:mod:`.common` and :mod:`.training` (what every case shares), then one module per case
(:mod:`.pruning`, :mod:`.sparse_attention`, :mod:`.freezing`, :mod:`.moe`, :mod:`.mod`,
:mod:`.early_exit`) and :mod:`.record` (the command line behind
``python -m benchmarks.trained --case pruning``).
"""
