"""Generate the Python gRPC stubs of ``protos/ftjax/v1/*.proto`` into one flat package directory.

Run by the CMake build (``CMakeLists.txt``) when ``grpc_tools`` is importable, and by hand:
``python protos/generate_stubs.py OUT_DIR``. protoc names the modules after the proto path
(``ftjax/v1/inference_pb2.py``, imported as ``from ftjax.v1 import ...``), which would clash with the
``ftjax`` package; the modules are therefore written flat into OUT_DIR (installed as
``ftjax/serve/_gen/``) and their imports of each other made relative. Nothing else is edited.
Exit code 0 on success, 1 when protoc fails or ``grpc_tools`` is missing.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "ftjax" / "v1"
_IMPORT = re.compile(r"^from ftjax\.v1 import (\w+_pb2)", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # build-time only dependency (grpcio-tools)
    import grpc_tools

    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {PACKAGE_DIR}")
    wkt = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{wkt}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *[str(p.relative_to(PROTO_ROOT)) for p in protos]]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args[1:])}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "ftjax" / "v1").iterdir()):
            text = _IMPORT.sub(r"from . import \1", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated from protos/ftjax/v1/*.proto at build time (protos/generate_stubs.py); '
                    'do not edit."""\n')
    return [init, *written]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path, help="directory to write the stub modules into")
    ap.add_argument("--stamp", type=Path, help="file to touch on success (for the build system)")
    args = ap.parse_args(argv)
    try:
        files = generate(args.out_dir)
    except ImportError as e:
        print(f"generate_stubs: grpc_tools is not importable ({e}); install grpcio-tools", file=sys.stderr)
        return 1
    except (RuntimeError, OSError) as e:
        print(f"generate_stubs: {e}", file=sys.stderr)
        return 1
    if args.stamp:
        args.stamp.touch()
    print(f"generate_stubs: wrote {len(files)} files to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
