from glob import glob

from setuptools import find_packages, setup

PACKAGE = "vla_node"

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(exclude=["test", "test.*"]),
    package_data={"vla_node.model": ["assets/tiny_tokenizer/*"], "vla_node": ["data/*", "data/sim_policy/*"]},
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml") + [f"{PACKAGE}/data/fastdds_large_frames.xml"]),
    ],
    # Exact pins live in requirements.txt; a ROS install provides rclpy and the messages.
    install_requires=["numpy", "torch", "safetensors", "tokenizers", "transformers", "pyyaml"],
    # `colcon test` runs pytest only for a package that names it as its test dependency (else
    # it falls back to unittest, which finds nothing).
    extras_require={"test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff"]},
    zip_safe=True,
    maintainer="vla_node maintainers",
    maintainer_email="maintainers@vla-node.dev",
    description="Real-time vision-language-action policies for ROS 2",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            # One name per tool, the same for pip (on PATH) and colcon (`ros2 run vla_node vla-node`).
            "vla-node = vla_node.ros.main:main",
            "vla-engine-server = vla_node.ros.engine_server:main",
            "vla-bench = vla_node.tools.bench:main",
            "vla-replay = vla_node.tools.replay:main",
            "vla-demo = vla_node.tools.demo:main",
            "vla-node-bench = vla_node.tools.node_bench:main",
            "vla-convert = vla_node.model.convert:main",
            "vla-sim = vla_node.sim.cli:main",
            "vla-soak = vla_node.tools.soak:main",
            "vla-train = vla_node.tools.train:main",
        ],
    },
)
