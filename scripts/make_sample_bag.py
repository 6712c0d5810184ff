"""Write the sample DROID-style bag (2 cameras 640x480 JPEG at 15 Hz, joint states at 100 Hz,
the instruction, reference actions). The shipped one was made with:

    python scripts/make_sample_bag.py vla_node/data/sample_droid.mcap

Longer or differently stored variants: --duration 30, --storage sqlite3 with a directory path,
--raw for uncompressed sensor_msgs/Image. The second shipped bag, the same scene as real robots
record it (QuirksSpec in vla_node/tools/sample_bag.py), was made with:

    python scripts/make_sample_bag.py --quirks vla_node/data/sample_quirks.mcap

The scene and motion live in vla_node/tools/sample_bag.py.
"""
from vla_node.tools.sample_bag import main

if __name__ == "__main__":
    main()
