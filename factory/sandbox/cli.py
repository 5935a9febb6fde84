"""`factory sandbox …`: build images, list them, check a backend. Wired into `factory.cli` by
`add_sandbox_commands(subparsers)`."""

from __future__ import annotations

import argparse
import json
import sys

from factory.sandbox.base import SandboxUnavailable
from factory.support.commands import command_parser, dispatch, fail


def cmd_build(args) -> int:
    from factory.sandbox.images import available_specs, build_image

    names = args.names or available_specs()
    try:
        for name in names:
            info = build_image(name, force=args.force, docker=False if args.no_docker else None)
            print(json.dumps(info))
    except SandboxUnavailable as err:
        return fail(str(err))
    return 0


def cmd_list(args) -> int:
    from factory.sandbox.images import available_specs, built_rootfs, docker_ready, image_info, load_spec

    docker = docker_ready()
    for name in available_specs():
        spec = load_spec(name)
        info = image_info(name) if docker else None
        image = "no engine" if not docker else ("not built" if info is None else
                                              f"{info['id'][7:19]} {info['size'] / 2**20:.0f} MiB"
                                              + ("" if info["spec_digest"] == spec.digest else " (stale)"))
        print(f"{name:12s} {spec.language:8s} rootfs: {'built' if built_rootfs(name) else 'not built':9s} docker: {image}")
    return 0


def cmd_check(args) -> int:
    from factory.sandbox import make_sandbox
    from factory.sandbox.base import run_blocking
    from factory.sandbox.health import check_sandbox

    try:
        sandbox = make_sandbox(args.backend, args.image)
    except SandboxUnavailable as err:
        return fail(str(err))
    try:
        report = run_blocking(check_sandbox(sandbox))
    finally:
        sandbox.close()
    for name, check in report["checks"].items():
        mark = "ok " if check["passed"] else "FAIL"
        print(f"{mark} {name:14s} expected {check['expected']:8s} got {check['reason']:12s} {check['wall_s']:.3f}s")
    print(f"{report['backend']}: {'healthy' if report['ok'] else 'UNHEALTHY'}")
    return 0 if report["ok"] else 1


def add_sandbox_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `sandbox build|list|check` to a `factory` CLI's subparsers (each sets `fn`)."""
    sandbox = subparsers.add_parser("sandbox", help="code sandboxes: build images, list them, check a backend")
    sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    build = sub.add_parser("build", help="build sandbox images (rootfs via debootstrap, then docker import)")
    build.add_argument("names", nargs="*", help="images under sandboxes/ (default: all)")
    build.add_argument("--force", action="store_true", help="rebuild even if the spec is unchanged")
    build.add_argument("--no-docker", action="store_true", help="build the rootfs only (bubblewrap)")
    build.set_defaults(fn=cmd_build)
    listing = sub.add_parser("list", help="sandbox images and whether they are built")
    listing.set_defaults(fn=cmd_list)
    check = sub.add_parser("check", help="run known-good and known-bad programs on a backend")
    check.add_argument("--backend", default="auto", choices=["auto", "bubblewrap", "docker"])
    check.add_argument("--image", default="python")
    check.set_defaults(fn=cmd_check)


def main(argv: list[str] | None = None) -> int:
    """`python -m factory.sandbox.cli …`: the sandbox commands alone."""
    return dispatch(command_parser(add_sandbox_commands)[0], argv)


if __name__ == "__main__":
    sys.exit(main())
