"""Sandbox images (one partition per `sandboxes/<name>/spec.yaml`) and their health check."""

import warnings

import dagster as dg
from pydantic import Field

from assets.runs import user_error
from factory.sandbox.images import available_specs

SANDBOX_IMAGES = dg.StaticPartitionsDefinition(available_specs())
DOCKER_CHOICES = {"auto": None, "yes": True, "no": False}


class SandboxImageConfig(dg.Config):
    force: bool = Field(False, description="rebuild even if the spec is unchanged")
    docker: str = Field("auto", description="auto: import into Docker when an engine answers; yes; no (rootfs only)")


@dg.asset(partitions_def=SANDBOX_IMAGES, group_name="sandboxes", kinds={"docker"}, pool="sandbox_build")
def sandbox_image(context: dg.AssetExecutionContext, config: SandboxImageConfig) -> dg.MaterializeResult:
    """A sandbox rootfs (debootstrap) and, where Docker runs, its image (`factory-sandbox-<name>:latest`)."""
    from factory.sandbox import SandboxUnavailable, build_image

    if config.docker not in DOCKER_CHOICES:
        raise user_error(f"docker: {config.docker!r}: choose one of {', '.join(DOCKER_CHOICES)}")
    docker = DOCKER_CHOICES[config.docker]
    try:
        info = build_image(context.partition_key, force=config.force, docker=docker, log=context.log.info)
    except SandboxUnavailable as err:
        raise user_error(str(err)) from None
    metadata = {
        "tag": info["tag"], "rootfs": dg.MetadataValue.path(info["rootfs"]), "spec_digest": info["spec_digest"],
        "rebuilt": info["rebuilt"],
    }
    if info["id"] is None:
        metadata["docker"] = "skipped: no Docker engine (bubblewrap uses the rootfs)"
    else:
        metadata.update(image_id=info["id"], digest=info["digest"], size_mb=round(info["size"] / 2**20, 1))
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(info["spec_digest"][:16]))


def _sandbox_health(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    """Known-good programs succeed and known-bad ones (infinite loop, memory bomb) are stopped for the right reason."""
    from factory.sandbox import SandboxUnavailable, make_sandbox
    from factory.sandbox.base import run_blocking
    from factory.sandbox.health import check_sandbox

    try:
        sandbox = make_sandbox("auto", context.partition_key)
    except SandboxUnavailable as err:
        return dg.AssetCheckResult(passed=False, metadata={"error": str(err)})
    try:
        report = run_blocking(check_sandbox(sandbox))
    finally:
        sandbox.close()
    checks = {name: f"{'ok' if c['passed'] else 'FAIL'}: expected {c['expected']}, got {c['reason']} in {c['wall_s']}s"
              for name, c in report["checks"].items()}
    return dg.AssetCheckResult(passed=report["ok"], metadata={"backend": report["backend"], **checks})


with warnings.catch_warnings():  # partitioned asset checks are a Dagster preview; we rely on them knowingly
    warnings.simplefilter("ignore", dg.PreviewWarning)
    sandbox_health = dg.asset_check(asset=sandbox_image, name="sandbox_health", partitions_def=SANDBOX_IMAGES,
                                    blocking=True)(_sandbox_health)
