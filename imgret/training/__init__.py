"""Offline training of image embeddings with metric-learning losses (the Reality-Check protocol).

Built on ``imgret`` (the model, the Embedder, the metrics); nothing here imports ``index`` or
``service``: a trained run's ``model.pt`` is what the gallery and the service load.

- ``config``: ``TrainConfig``, every hyper-parameter of a run, frozen and validated;
- ``data``: image sources, their splits, the training dataset and sampler (a package);
- ``registry``: loss and miner names -> pytorch-metric-learning objects, with their
  defaults and search spaces;
- ``loop``: ``train(config, out)``, the training loop in named stages (``imgret train``);
- ``distributed``: one process or many under ``torchrun``, behind the same calls;
- ``scoring``: a run's validation and test numbers (and the baselines), by one function;
- ``run_dir``: what a run writes, and how it is read back (resume, a finished run);
- ``benchmark``: losses x seeds on one shared base config (``imgret benchmark``);
- ``tune``: equal-budget tuning of every loss, then the benchmark (``imgret tune``);
- ``report``: the benchmark's results aggregated over seeds;
- ``analysis``: paired verdicts between losses, and time to convergence;
- ``plots``: the curves and bar charts.
"""
