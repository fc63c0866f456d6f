"""Training data: image sources, their train / val / test splits, the training dataset and
the m-per-class sampler.

- :mod:`~imgret.training.data.sources`: what ``--data`` names, as labelled images by index;
- :mod:`~imgret.training.data.splits`: the class-disjoint / closed-set splits (seeded, documented);
- :mod:`~imgret.training.data.datasets`: the training split as a torch ``Dataset``, its
augmentation;
- :mod:`~imgret.training.data.sampler`: batches of m images per class, from the sampler's own
  seeded generator.

Bad data is reported, not crashed on: each module says how.
"""

from imgret.training.data.datasets import TrainDataset, train_transform
from imgret.training.data.sampler import (
    MPerClassSampler,
    RandomBatchSampler,
    plan_batches,
    plan_random_batches,
)
from imgret.training.data.sources import (
    ImageSource,
    image_sizes,
    iter_images,
    model_spec_for,
    open_source,
)
from imgret.training.data.splits import (
    DataSplit,
    class_folds,
    describe_split,
    make_split,
    stratified_subset,
)

__all__ = [
    "DataSplit",
    "ImageSource",
    "MPerClassSampler",
    "RandomBatchSampler",
    "TrainDataset",
    "class_folds",
    "describe_split",
    "image_sizes",
    "iter_images",
    "make_split",
    "model_spec_for",
    "open_source",
    "plan_batches",
    "plan_random_batches",
    "stratified_subset",
    "train_transform",
]
