"""megatron-seq1f1b: sequence-level 1F1B pipeline parallelism for Megatron-Core."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

setup(
    name="megatron-seq1f1b",
    version="0.1.0",
    description="Seq1F1B: sequence-level 1F1B pipeline parallelism for NVIDIA Megatron-Core",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["megatron_seq1f1b", "megatron_seq1f1b.*"]),
    # The Megatron-LM patches ship with the package: `python -m megatron_seq1f1b.patch`
    # (the `seq1f1b-patch` command) applies them to a checkout without this repository.
    package_data={"megatron_seq1f1b.megatron_lm": ["patches/megatron-lm/*/*.patch"]},
    entry_points={"console_scripts": ["seq1f1b-patch = megatron_seq1f1b.megatron_lm.patch:main"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
    ],
    extras_require={
        # The trainer (scripts/pretrain_gpt.py): numpy for Megatron-Core's datasets, psutil
        # for Megatron-Core's distributed checkpoint writer (--use-distributed-optimizer --save).
        "train": ["numpy", "psutil"],
        # Tests run on CPU with gloo and use the trainer.
        "test": ["pytest>=7", "numpy", "psutil", "einops"],  # einops: Megatron's Mamba-2 layer
        # Pictures of schedules (PNG); the Chrome trace needs nothing extra.
        "plot": ["matplotlib"],
        # Hugging Face models through NVIDIA Megatron-Bridge (megatron_seq1f1b.bridge, docs/bridge.md):
        # what Bridge's conversion path imports. Bridge itself declares Python >=3.12 and a large
        # set it does not import there: on 3.12 it comes with them (its own way); on older
        # interpreters scripts/setup_bridge.sh installs it with --no-deps --ignore-requires-python.
        "bridge": [
            "megatron-bridge>=0.6.2; python_version >= '3.12'",
            "transformers>=5.8,<=5.12.1",  # Bridge 0.6.2's range: HF models, configs, files
            "omegaconf",  # Bridge's configuration utilities
            "rich",  # Bridge's conversion progress bars
        ],
        # Optional on GPUs: Transformer Engine attention (causal_bottom_right masks).
        # NVIDIA apex is not on PyPI; see docs/troubleshooting.md.
        "gpu": ["transformer-engine[pytorch]"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
