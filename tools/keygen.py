"""Create the cluster's CURVE key pair for an authenticated, encrypted bus.

    python -m tools.keygen DIR            # writes DIR/cluster.key (public) and DIR/cluster.key_secret (0600)
    python -m tools.keygen DIR --force    # replace existing keys (every node must then get the new pair)

Copy DIR to every node and point the launcher at it (`--curve-keys DIR`); actors holding the pair can talk to each
other, and a peer without it cannot complete the CURVE handshake, so nothing it sends is delivered. Keep the secret
file private when copying (`scp -p`, or `chmod 600` after): the launcher refuses one that group or others can read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bus.security import PUBLIC_FILE, SECRET_FILE, generate_cluster_keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create the cluster's CURVE key pair.")
    parser.add_argument("directory", type=Path, help="where to write cluster.key and cluster.key_secret")
    parser.add_argument("--force", action="store_true", help="overwrite existing cluster keys")
    args = parser.parse_args(argv)
    try:
        keys = generate_cluster_keys(args.directory, force=args.force)
    except FileExistsError as exc:
        print(f"keygen: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.directory / PUBLIC_FILE} and {args.directory / SECRET_FILE} (mode 0600)")
    print(f"cluster public key: {keys.public.decode()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
