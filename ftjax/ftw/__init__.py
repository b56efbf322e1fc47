"""FTW store: HF safetensors -> zarr v3 (tensorstore) + ``ftw.json`` manifest, and its loader.

``convert`` writes a store, ``load_store`` reads it into device params and host expert banks,
``verify_store`` checks every checksum. The HF reader lives in ``ftjax.ftw.hf``.
"""
from ftjax.ftw.convert import ConvertError, convert
from ftjax.ftw.load import LoadedModel, load_store, verify_store
from ftjax.ftw.manifest import StoreError

__all__ = ["convert", "load_store", "verify_store", "LoadedModel", "StoreError", "ConvertError"]
