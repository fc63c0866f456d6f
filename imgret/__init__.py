"""imgret: image retrieval, from training an embedding to serving searches.

The subpackages are the layers, each importing only those below it
(``tests/unit/test_layering.py``):

- ``imgret.training``: learns embeddings and compares losses fairly (the Reality Check);
- ``imgret.gallery``: the gallery in SQL, its media, and the FAISS index derived from it;
- ``imgret.service``: the FastAPI service over the index;
- ``imgret.cli``: the ``imgret`` command, on top of all of them;
- ``imgret.migrations``: the Alembic migrations of the gallery schema.

The top-level modules are the core every layer builds on; none imports a subpackage:

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
