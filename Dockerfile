# The image every kustomization of k8s/ runs but the development one: Ray's image with elastic
# installed, so a new Ray pod runs a rank as soon as it starts and installs nothing (only
# k8s/overlays/dev pip-installs the package on every node at start: minutes per node).
#   docker build -t elastic-trainer:0.1.0-cpu .
#   docker build -t elastic-trainer:0.1.0-gpu --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#                --build-arg TORCH_INDEX= .
# Your model's module goes into an image of your own on top: FROM elastic-trainer:0.1.0-cpu, then
# COPY it under /home/ray and set PYTHONPATH (or pip install your package).
# tests/test_k8s_manifests.py checks that the Ray version and Python here are the ones
# constraints.txt and the RayJob name, and that the tags are the ones the overlays run.

# Ray's own image, of the ray version constraints.txt pins, for Python 3.11.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${RAY_IMAGE}

# Where torch comes from besides PyPI: the CPU wheels by default (torch==2.13.0+cpu, a few hundred
# MB instead of the multi-GB CUDA build); empty for PyPI's CUDA build, for the GPU image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

WORKDIR /home/ray/elastic-src
# Only what the package needs (.dockerignore keeps the rest out of the build context).
COPY --chown=1000:100 pyproject.toml constraints.txt README.md LICENSE ./
COPY --chown=1000:100 elastic ./elastic
# constraints.txt pins torch and ray to the versions the tests run against; the image's ray
# already matches, so pip keeps it.
RUN pip install --no-cache-dir -c constraints.txt ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} . \
 && python -c "import elastic, ray, torch; print('elastic', elastic.__version__, 'ray', ray.__version__, 'torch', torch.__version__)"

# Ray's image user "ray" (uid 1000, gid 100): the manifests run every container as it.
USER 1000:100
WORKDIR /home/ray
