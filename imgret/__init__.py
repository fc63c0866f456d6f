"""imgret: the shared core that every layer builds on (``training``, ``index``, ``service``).

No module here imports those layers, and the command line lives in ``cli``.

- ``settings``: the ``IMGRET_*`` environment variables, validated at start;
- ``errors``: the domain exceptions (4xx in the service, one-line messages in the CLI);
- ``config_rules``: the bounds of a model spec, and pydantic refusals as imgret errors;
- ``images``: the only decoder of user bytes, with its pixel budget and decode gate;
- ``transforms``: the only inference preprocessing (PIL image -> normalised tensor);
- ``backbones``: backbone name -> torchvision trunk;
- ``checkpoint``: the embedding network, its spec, and the checked loading of a checkpoint;
- ``embedder``: the ``Embedder``, the one path from images to vectors;
- ``datasets``: labelled image lists (ImageFolder, CSV, Market-1501) and Fashion-MNIST files;
- ``metrics``: retrieval metrics, one exact implementation (a package);
- ``stats``: 95% intervals (Student-t over seeds, bootstrap over queries, paired);
- ``files``: crash-safe atomic writes and the clean-up of their temporary files;
- ``process``: long-running work: long-lived objects kept out of the garbage collector,
  torch work on threads that end with it;
- ``timing``: the one timer.
"""

__version__ = "0.1.0"
