"""nox sessions for the fi monorepo, driven by one PACKAGES list.

    nox -s tests            CPU tests of every package (tests(fi-core), tests(fi-sampling), ...)
    nox -s compile          nvcc builds of every registered kernel's representative variants for
                            sm_80 and sm_90a; fails on ptxas spills or serialised wgmma (C7510);
                            then an FI_AOT=1 wheel must load all its kernels without nvcc
    nox -s gpu              GPU-marked tests with the current interpreter (the H200 machine)
    nox -s lint             ruff
    nox -s build            a wheel per package into dist/
"""

import nox

PACKAGES = ["fi-core", "fi-attention", "fi-gemm", "fi-moe", "fi-sampling", "fi-comm", "flashinfer"]
nox.options.sessions = ["tests", "lint"]


def _dev_install(session):
    session.install("-r", "requirements-dev.txt")


@nox.session
@nox.parametrize("pkg", PACKAGES)
def tests(session, pkg):
    _dev_install(session)
    session.run("python", "-m", "pytest", "-m", "not gpu", f"packages/{pkg}/tests", *session.posargs,
                success_codes=[0])


@nox.session
def compile(session):
    _dev_install(session)
    session.run("python", "tools/compile_check.py", "--arch", "8.0", "--arch", "9.0a", *session.posargs)
    session.run("python", "tools/aot_check.py", "--package", "fi-sampling", "--arch", "9.0a")


@nox.session(python=False, venv_backend="none")
def gpu(session):
    session.run("python3", "-m", "pytest", "-m", "gpu", *(f"packages/{p}/tests" for p in PACKAGES),
                *session.posargs)


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", "packages", "tools", "noxfile.py")


@nox.session
def build(session):
    session.install("build", "hatchling")
    for pkg in PACKAGES:
        session.run("python", "-m", "build", "--wheel", "--outdir", "dist", f"packages/{pkg}")
