"""Data: batch samplers, built-in data sets and loaders for users' files."""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "PKSampler": "samplers",
        "IdentitySimulator": "identities",
        "stratified_split": "splits",
        "stratified_subset": "splits",
        "dataset_options": "datasets",
        "FILE_FORMATS": "datasets",
        "DATASETS": "datasets",
        "Split": "datasets",
        "DatasetSplits": "datasets",
        "load_dataset": "datasets",
    },
)
