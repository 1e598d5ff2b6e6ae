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
        "BadSampleError": "samples",
        "LazySamples": "samples",
        "concat_samples": "samples",
        "is_lazy": "samples",
        "read_or_skip": "samples",
        "decode_image": "decode",
        "scan_folder": "folder",
        "read_manifest": "manifest",
        "read_recordio": "recordio",
        "ShardSamples": "shards",
        "open_shards": "shards",
        "write_shards": "shards",
    },
)
