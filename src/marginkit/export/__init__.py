"""From a trained run to deployable files: the embedding model as ONNX or TorchScript in a
bundle directory with its K-NN index, preprocessing, calibration table and fingerprint.

Needs ``pip install 'marginkit[export]'`` (onnx, onnxruntime, onnxscript) for ONNX.
See docs/deploy.md.
"""

from marginkit._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    {
        "Bundle": "bundle",
        "BundleError": "bundle",
        "load_bundle": "bundle",
        "ExportError": "writer",
        "export_model": "writer",
        "calibration_table": "calibration",
        "CALIBRATION_FARS": "calibration",
        "FORMATS": "model_file",
        "read_npz": "npz",
        "NpzError": "npz",
    },
)
