"""rosbag2 bags (sqlite3 and mcap) in and out, and a bag's inputs turned into engine Observations.

One module for the replay tool, the demo, the sample-bag script and the tests. It reads and
writes with `rosbags` and imports nothing from ROS, so offline evaluation also runs on machines
without ROS.

Damage: a bag that cannot be opened because its storage file was cut off (a recording killed
before it closed the file, an interrupted copy) is copied up to the damage into a temporary file
that `rosbags` can read; damage met while reading stops the stream. Either way the reader keeps
everything before the damage and `Bag.damage` says where it stopped.
"""
from __future__ import annotations

import mmap
import shutil
import sqlite3
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import apsw
import cv2
import numpy as np
from rosbags.highlevel import AnyReader, AnyReaderError
from rosbags.rosbag2 import CompressionFormat, CompressionMode, ReaderError, StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from ..runtime import Observation, WindowLayout, images
from ..runtime.timeline import InputTimeline
from ..runtime.windows import (
    MAX_CAMERA_RATE_HZ,
    PANDA_JOINTS,
    STATE_SLOP_S,
    SYNC_SLOP_S,
    InputError,
    Wait,
    WindowSpec,
    frames_to_keep,
)

# Kilted's message definitions; bags that embed their own definitions are read with those.
TYPESTORE = get_typestore(Stores.ROS2_KILTED)

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED_IMAGE = "sensor_msgs/msg/CompressedImage"
JOINT_STATE = "sensor_msgs/msg/JointState"
STRING = "std_msgs/msg/String"
FLOAT64_MULTI_ARRAY = "std_msgs/msg/Float64MultiArray"
JOINT_TRAJECTORY = "trajectory_msgs/msg/JointTrajectory"
DIAGNOSTIC_ARRAY = "diagnostic_msgs/msg/DiagnosticArray"
CLOCK = "rosgraph_msgs/msg/Clock"

# The node's input topics (its defaults); a bag may hold a camera as `<topic>/compressed`.
CAMERA_TOPICS = ("/cameras/exo/image_raw", "/cameras/wrist/image_raw")
JOINT_STATES_TOPIC = "/joint_states"
INSTRUCTION_TOPIC = "/instruction"
CLOCK_TOPIC = "/clock"
# Reference actions: one JointTrajectory per camera frame, stamped with that frame's stamp,
# point k = action k of the chunk (a demonstration's next actions, or a recorded node's output).
REFERENCE_TOPIC = "/reference/joint_trajectory"
# A demonstration's commands (what a policy learns to output): one JointState per control tick,
# stamped with the tick's time; its positions are the target held from that tick to the next.
DEMO_COMMAND_TOPIC = "/expert/joint_command"
COMPRESSED_SUFFIX = "/compressed"
# The node's default joint_names, sync_slop_s, state_slop_s and max_camera_rate_hz (vla_node.runtime.windows).
JOINT_NAMES = PANDA_JOINTS

STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
STORAGE_SUFFIXES = {".mcap": "mcap", ".db3": "sqlite3"}


class BagError(Exception):
    """A bag, topic or message the tools cannot use; the message says which and why."""


# -- time ---------------------------------------------------------------------------------------
def stamp_ns(stamp) -> int:
    """builtin_interfaces/Time -> integer nanoseconds."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def time_msg(ns: int):
    Time = TYPESTORE.types["builtin_interfaces/msg/Time"]
    return Time(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def duration_msg(ns: int):
    Duration = TYPESTORE.types["builtin_interfaces/msg/Duration"]
    return Duration(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def header_msg(ns: int, frame_id: str = ""):
    return TYPESTORE.types["std_msgs/msg/Header"](stamp=time_msg(ns), frame_id=frame_id)


# -- messages the tools write (rosbags objects, serialised with rosbags) ------------------------
def image_msg(rgb: np.ndarray, ns: int, frame_id: str = "", encoding: str = "rgb8"):
    """An rgb8 or bgr8 sensor_msgs/Image of an HxWx3 RGB array."""
    height, width = rgb.shape[:2]
    pixels = {"rgb8": rgb, "bgr8": rgb[..., ::-1]}[encoding]
    return TYPESTORE.types[IMAGE](header=header_msg(ns, frame_id), height=height, width=width, encoding=encoding,
                                  is_bigendian=0, step=width * 3, data=np.ascontiguousarray(pixels).reshape(-1))


def clock_msg(ns: int):
    return TYPESTORE.types[CLOCK](clock=time_msg(ns))


def compressed_image_msg(rgb: np.ndarray, ns: int, frame_id: str = "", quality: int = 85):
    ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise BagError("JPEG encoding failed")
    # image_transport's format string for a colour JPEG.
    return TYPESTORE.types[COMPRESSED_IMAGE](header=header_msg(ns, frame_id), format="rgb8; jpeg compressed bgr8",
                                             data=jpeg.reshape(-1))


def joint_state_msg(ns: int, names: Sequence[str], position, velocity=(), effort=()):
    return TYPESTORE.types[JOINT_STATE](header=header_msg(ns), name=list(names),
                                        position=np.asarray(position, np.float64),
                                        velocity=np.asarray(velocity, np.float64),
                                        effort=np.asarray(effort, np.float64))


def string_msg(text: str):
    return TYPESTORE.types[STRING](data=text)


def joint_trajectory_msg(ns: int, names: Sequence[str], positions: np.ndarray, step_ns: int):
    """positions [points, joints]; point k is due (k + 1) * step_ns after the stamp."""
    Point = TYPESTORE.types["trajectory_msgs/msg/JointTrajectoryPoint"]
    empty = np.zeros(0, np.float64)
    points = [Point(positions=np.asarray(p, np.float64), velocities=empty, accelerations=empty, effort=empty,
                    time_from_start=duration_msg((k + 1) * step_ns)) for k, p in enumerate(positions)]
    return TYPESTORE.types[JOINT_TRAJECTORY](header=header_msg(ns), joint_names=list(names), points=points)


def trajectory_positions(msg) -> np.ndarray:
    """JointTrajectory -> [points, joints] float32."""
    if not msg.points:
        return np.zeros((0, len(msg.joint_names)), np.float32)
    return np.stack([np.asarray(p.positions, np.float32) for p in msg.points])


def canonical_cdr(raw: bytes, msgtype: str) -> bytes:
    """CDR bytes from DDS/rclpy -> the same message as rosbags serialises it. Fast DDS may append
    uninitialised bytes after the message, which rosbags refuses to read back."""
    msgdef = TYPESTORE.get_msgdef(msgtype)
    little_endian = bool(raw[1])
    decode = msgdef.deserialize_cdr_le if little_endian else msgdef.deserialize_cdr_be
    message, _ = decode(raw[4:], 0, msgdef.cls, TYPESTORE)
    return bytes(TYPESTORE.serialize_cdr(message, msgtype))


def decode_image(msg, topic: str) -> np.ndarray:
    """sensor_msgs Image or CompressedImage -> HxWx3 uint8 RGB, converted as the node does
    (vla_node.runtime.images)."""
    try:
        return images.decode(msg)
    except InputError as err:
        raise BagError(f"{topic}: cannot use this image: {err}") from None


# -- writing ------------------------------------------------------------------------------------
class BagWriter:
    """A new bag. `path` naming a `.mcap` / `.db3` file writes a single self-contained storage
    file (the bag directory's metadata.yaml is not needed to read it); any other path is a
    rosbag2 directory in `storage` format."""

    def __init__(self, path: str | Path, storage: str = "mcap", compress: bool = False):
        """compress: zstd-compressed chunks in an mcap file (bags shipped in the repository);
        sqlite3 stores messages as they are."""
        self.path = Path(path)
        if self.path.exists():
            raise BagError(f"{self.path} exists already; not overwriting")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.suffix in STORAGE_SUFFIXES:
            storage = STORAGE_SUFFIXES[self.path.suffix]
            self._staging = Path(tempfile.mkdtemp(prefix="bag_", dir=self.path.parent))
            directory = self._staging / self.path.stem
        else:
            self._staging = None
            directory = self.path
        if storage not in STORAGES:
            raise BagError(f"unknown storage {storage!r}; known: {sorted(STORAGES)}")
        self._writer = Writer(directory, version=Writer.VERSION_LATEST, storage_plugin=STORAGES[storage])
        if compress and storage == "mcap":
            self._writer.set_compression(CompressionMode.STORAGE, CompressionFormat.ZSTD)
        self._writer.open()
        self._connections = {}

    def add_topic(self, topic: str, msgtype: str) -> None:
        if topic in self._connections:
            return
        if msgtype not in TYPESTORE.fielddefs:
            raise BagError(f"{topic}: message type {msgtype} is not known to the {Stores.ROS2_KILTED.name} typestore")
        self._connections[topic] = self._writer.add_connection(topic, msgtype, typestore=TYPESTORE)

    def write(self, topic: str, msgtype: str, time_ns: int, msg) -> None:
        """Write a rosbags message object."""
        self.write_cdr(topic, msgtype, time_ns, TYPESTORE.serialize_cdr(msg, msgtype))

    def write_image(self, topic: str, time_ns: int, rgb: np.ndarray, stamp_ns: int, frame_id: str = "",
                    jpeg_quality: Optional[int] = None) -> None:
        """A camera frame [H, W, 3] uint8 RGB: a raw rgb8 Image on `topic`, or with jpeg_quality a
        JPEG CompressedImage on `topic`/compressed (image_transport's name for it)."""
        if jpeg_quality is None:
            self.write(topic, IMAGE, time_ns, image_msg(rgb, stamp_ns, frame_id))
        else:
            self.write(topic + COMPRESSED_SUFFIX, COMPRESSED_IMAGE, time_ns,
                       compressed_image_msg(rgb, stamp_ns, frame_id, jpeg_quality))

    def write_cdr(self, topic: str, msgtype: str, time_ns: int, data: bytes) -> None:
        """Write CDR bytes as rosbags would serialise them (see canonical_cdr for DDS bytes)."""
        self.add_topic(topic, msgtype)
        self._writer.write(self._connections[topic], int(time_ns), data)

    def close(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        if self._staging is not None:
            written = next(p for p in (self._staging / self.path.stem).iterdir() if p.suffix == self.path.suffix)
            shutil.move(written, self.path)
            shutil.rmtree(self._staging)

    def __enter__(self) -> "BagWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- reading ------------------------------------------------------------------------------------
@dataclass
class Damage:
    """Where reading stopped, and why."""
    reason: str
    messages_read: int                     # messages of the requested topics read before it stopped
    last_time_ns: Optional[int]            # log time of the last message read

    def describe(self, start_ns: Optional[int]) -> str:
        if self.last_time_ns is None or start_ns is None:
            where = f"after {self.messages_read} messages"
        else:
            where = f"after {self.messages_read} messages, {(self.last_time_ns - start_ns) / 1e9:.2f} s into the bag"
        return f"stopped {where}: {self.reason}"

    def to_dict(self, start_ns: Optional[int]) -> dict:
        return {"reason": self.reason, "messages_read": self.messages_read,
                "last_time_s": None if self.last_time_ns is None or start_ns is None
                else (self.last_time_ns - start_ns) / 1e9,
                "summary": self.describe(start_ns)}


# What the storage backends raise on damaged data.
READ_ERRORS = (AnyReaderError, ReaderError, apsw.Error, sqlite3.Error, struct.error, EOFError, OSError,
               ValueError, KeyError, IndexError)


class Bag:
    """An opened bag (directory, or a single .mcap / .db3 file). Use as a context manager."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.notes: list[str] = []     # what was repaired to open it
        self._open_damage: Optional[str] = None     # found while opening (salvaged)
        self._stream_damage: Optional[str] = None   # met by the latest messages() stream
        self.messages_read = 0                      # progress of the latest messages() stream
        self.last_time_ns: Optional[int] = None
        self._tmp: Optional[tempfile.TemporaryDirectory] = None
        if not self.path.exists():
            raise BagError(f"no bag at {self.path}")
        if self.path.is_file() and self.path.suffix not in STORAGE_SUFFIXES:
            raise BagError(f"{self.path} is not a bag: expected a rosbag2 directory or a .mcap / .db3 file")
        try:
            self._reader = self._open_reader(self.path)
        except (READ_ERRORS + (FileNotFoundError,)) as err:
            self._reader = self._open_fallback(err)
        self.topics: dict[str, str] = {c.topic: c.msgtype for c in self._reader.connections}
        self.start_ns: Optional[int] = self._reader.start_time if self._reader.message_count else None
        self.end_ns: Optional[int] = self._reader.end_time if self._reader.message_count else None
        self.message_count: int = self._reader.message_count

    def _storage_files(self) -> list[Path]:
        return [self.path] if self.path.is_file() else [*self.path.glob("*.mcap"), *self.path.glob("*.db3")]

    @property
    def storage(self) -> str:
        files = self._storage_files()
        return STORAGE_SUFFIXES[files[0].suffix] if files else "?"

    @property
    def duration_s(self) -> float:
        return 0.0 if self.start_ns is None else (self.end_ns - self.start_ns) / 1e9

    @staticmethod
    def _open_reader(target: Path) -> AnyReader:
        reader = AnyReader([target], default_typestore=TYPESTORE)
        reader.open()
        return reader

    def _open_fallback(self, err: Exception) -> AnyReader:
        """The bag did not open as it is. A directory whose metadata.yaml is missing (a recording
        that was killed never writes it) or unusable: read its storage file directly. A storage
        file cut off or damaged: copy what precedes the damage to a temporary file and read that."""
        storage_files = self._storage_files()
        if not storage_files:
            raise BagError(f"{self.path} is not a rosbag2 bag: no metadata.yaml, no .mcap or .db3 file")
        if len(storage_files) != 1:
            raise BagError(f"{self.path} is not a readable rosbag2 bag ({err}; "
                           f"{len(storage_files)} storage files .mcap/.db3 in it)") from None
        source = storage_files[0]
        if self.path.is_dir():
            try:
                reader = self._open_reader(source)
                self.notes.append(f"metadata.yaml missing or unusable ({err}): read {source.name} directly")
                return reader
            except READ_ERRORS:
                pass
        self._tmp = tempfile.TemporaryDirectory(prefix="salvaged_bag_")
        copy = Path(self._tmp.name) / source.name
        salvage = salvage_mcap if source.suffix == ".mcap" else salvage_sqlite
        try:
            reason = salvage(source, copy)
            reader = self._open_reader(copy)
        except (BagError,) + READ_ERRORS as salvage_err:
            self._tmp.cleanup()
            raise BagError(f"{self.path} is not a readable rosbag2 bag ({err}; nothing before the damage "
                           f"could be recovered: {salvage_err})") from None
        if not reader.message_count:
            reader.close()
            self._tmp.cleanup()
            raise BagError(f"{self.path} is not a readable rosbag2 bag ({err}); no messages before the damage")
        self._open_damage = f"{source.name}: {reason}"
        return reader

    def close(self) -> None:
        self._reader.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "Bag":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def deserialize(self, raw: bytes, msgtype: str, topic: str = ""):
        try:
            return self._reader.deserialize(raw, msgtype)
        except AnyReaderError as err:
            raise BagError(f"{topic}: cannot decode a {msgtype} message: {err}") from None

    def require(self, topic: str, msgtypes: Sequence[str]) -> str:
        """The topic's type, or a clear error if the bag lacks it or holds a type we cannot use."""
        if topic not in self.topics:
            raise BagError(f"topic {topic} is not in {self.path}; it has: {', '.join(sorted(self.topics)) or 'none'}")
        if self.topics[topic] not in msgtypes:
            raise BagError(f"topic {topic} holds {self.topics[topic]}, which cannot be used here "
                           f"(expected {' or '.join(msgtypes)})")
        return self.topics[topic]

    @property
    def damage(self) -> Optional[Damage]:
        """Where the latest stream stopped and why, if the bag is damaged."""
        reason = self._stream_damage or self._open_damage
        return Damage(reason, self.messages_read, self.last_time_ns) if reason else None

    def mark_damaged(self, reason: str) -> None:
        """A reader of the stream found a message it cannot decode: the stream stops there."""
        self._stream_damage = reason

    def messages(self, topics: Sequence[str]) -> Iterator[tuple[str, str, int, bytes]]:
        """(topic, msgtype, log time ns, raw CDR) in log-time order. Damage ends the stream and is
        reported by self.damage (with how far reading got) instead of raising."""
        connections = [c for c in self._reader.connections if c.topic in set(topics)]
        self.messages_read, self.last_time_ns, self._stream_damage = 0, None, None
        stream = self._reader.messages(connections=connections)
        while True:
            try:
                connection, time_ns, raw = next(stream)
            except StopIteration:
                return
            except READ_ERRORS as err:
                self.mark_damaged(f"{type(err).__name__}: {err}")
                return
            self.messages_read += 1
            self.last_time_ns = time_ns
            yield connection.topic, connection.msgtype, time_ns, raw

    def first_message(self, topic: str):
        """The first message of a topic, deserialised (None if it has none before any damage)."""
        for _, msgtype, _, raw in self.messages([topic]):
            return self.deserialize(raw, msgtype, topic)
        return None


def salvage_mcap(source: Path, copy: Path) -> str:
    """Copy the complete data records of an MCAP file cut off or damaged part-way, then close the
    copy with a footer without summary (readers scan it). Records of an uncompressed chunk cut off
    part-way are kept as loose records. Returns where the damage starts."""
    magic = b"\x89MCAP0\r\n"
    if source.stat().st_size < len(magic):
        raise BagError("not an MCAP file (too short)")
    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, \
            open(copy, "wb") as out:
        if data[:len(magic)] != magic:
            raise BagError("not an MCAP file (bad magic)")
        out.write(magic)
        pos, stop = len(magic), None
        while pos < len(data):
            if pos + 9 > len(data):
                stop = f"cut off at byte {pos} inside a record header"
                break
            opcode = data[pos]
            (length,) = struct.unpack_from("<Q", data, pos + 1)
            end = pos + 9 + length
            if opcode in (0x02, 0x0F):   # footer / data end: every message is behind us
                stop = "the summary or footer is damaged (every data record kept)"
                break
            if end > len(data):
                stop = f"cut off at byte {len(data)} inside a record that starts at byte {pos}"
                if opcode == 0x06:
                    out.write(_partial_chunk_records(data[pos + 9:]))
                break
            if opcode != 0x07:   # message indexes point into the original file's layout
                out.write(data[pos:end])
            pos = end
        # Data End (crc 0 = none), a Footer without summary, the closing magic.
        out.write(b"\x0f" + struct.pack("<QI", 4, 0) + b"\x02" + struct.pack("<QQQI", 20, 0, 0, 0) + magic)
    return stop or f"cut off at byte {pos} (a record boundary)"


def _partial_chunk_records(content: bytes) -> bytes:
    """Complete records inside an uncompressed chunk whose end is missing."""
    head = 8 + 8 + 8 + 4
    if len(content) < head + 4:
        return b""
    (name_len,) = struct.unpack_from("<I", content, head)
    compression = content[head + 4:head + 4 + name_len]
    pos = head + 4 + name_len + 8
    if compression != b"" or pos > len(content):
        return b""
    kept = bytearray()
    while pos + 9 <= len(content):
        (length,) = struct.unpack_from("<Q", content, pos + 1)
        end = pos + 9 + length
        if end > len(content):
            break
        kept += content[pos:end]
        pos = end
    return bytes(kept)


def salvage_sqlite(source: Path, copy: Path) -> str:
    """Copy every table of a damaged rosbag2 sqlite3 file row by row (insertion order) until a row
    cannot be read. Returns where the damage starts."""
    src = sqlite3.connect(f"file:{source}?mode=ro&immutable=1", uri=True)
    # SQLite refuses a file shorter than its header says, unless the schema is "writable": then
    # it reads the pages that are there.
    src.execute("PRAGMA writable_schema=ON")
    dst = sqlite3.connect(copy)
    stop = None
    try:
        try:
            schema = src.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall()
        except sqlite3.DatabaseError as err:
            raise BagError(f"sqlite schema unreadable: {err}") from None
        for kind, name, sql in schema:
            if kind != "table":
                continue
            dst.execute(sql)
            copied = 0
            try:
                for row in src.execute(f'SELECT * FROM "{name}" ORDER BY rowid'):
                    dst.execute(f'INSERT INTO "{name}" VALUES ({",".join("?" * len(row))})', row)
                    copied += 1
            except sqlite3.DatabaseError as err:
                stop = stop or f"table {name} unreadable after {copied} rows ({err})"
        for kind, name, sql in schema:
            if kind == "index":
                dst.execute(sql)
        dst.commit()
    finally:
        src.close()
        dst.close()
    return stop or "storage file could not be opened as it was (all rows copied)"


# -- observations -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CameraInput:
    name: str           # the layout's camera name
    topic: str          # topic in the bag
    msgtype: str        # Image or CompressedImage


@dataclass(frozen=True)
class BagInputs:
    """The bag's topics for each of the engine's inputs."""
    cameras: tuple[CameraInput, ...]
    joint_states: str
    instruction: Optional[str]        # None: the instruction is given on the command line
    reference: Optional[str]          # None: the bag holds no reference actions

    @property
    def topics(self) -> list[str]:
        topics = [c.topic for c in self.cameras] + [self.joint_states]
        return topics + ([self.instruction] if self.instruction else [])


def resolve_inputs(bag: Bag, camera_names: Sequence[str], camera_topics: Sequence[str] = CAMERA_TOPICS,
                   joint_states: str = JOINT_STATES_TOPIC, instruction: Optional[str] = INSTRUCTION_TOPIC,
                   reference: Optional[str] = REFERENCE_TOPIC) -> BagInputs:
    """The bag's topic for each input; clear errors for missing topics and unusable types. A camera
    topic matches its raw or its /compressed variant. instruction=None: no instruction topic is
    needed; reference is optional either way."""
    if len(camera_names) != len(camera_topics):
        raise BagError(f"{len(camera_topics)} camera topics for the layout's {len(camera_names)} cameras "
                       f"{list(camera_names)}")
    cameras = []
    for name, topic in zip(camera_names, camera_topics):
        # A camera recorded raw or through image_transport's compressed topic serves either.
        base = topic.removesuffix(COMPRESSED_SUFFIX)
        found = next((t for t in (topic, base, base + COMPRESSED_SUFFIX) if t in bag.topics), None)
        if found is None:
            raise BagError(f"camera topic {base} (or {base}{COMPRESSED_SUFFIX}) is not in {bag.path}; "
                           f"it has: {', '.join(sorted(bag.topics)) or 'none'}")
        cameras.append(CameraInput(name, found, bag.require(found, (IMAGE, COMPRESSED_IMAGE))))
    bag.require(joint_states, (JOINT_STATE,))
    if instruction is not None:
        bag.require(instruction, (STRING,))
    if reference is not None and reference in bag.topics:
        bag.require(reference, (JOINT_TRAJECTORY,))
    else:
        reference = None
    return BagInputs(tuple(cameras), joint_states, instruction, reference)


def read_references(bag: Bag, topic: str) -> dict[int, np.ndarray]:
    """Reference chunks keyed by header stamp (ns): [points, joints] float32 each."""
    return {stamp_ns(msg.header.stamp): trajectory_positions(msg)
            for msg in (bag.deserialize(raw, msgtype, topic) for _, msgtype, _, raw in bag.messages([topic]))}


@dataclass
class BagFrame:
    """One query: the observation the node would send if it sent one at `log_time_ns`."""
    index: int                  # 0-based count of queries
    observation: Observation
    log_time_ns: int            # when the message that completed its window was recorded
    stamp_ns: int               # the header stamp of its newest frame (the observation's stamp)
    state_stamps_ns: np.ndarray  # [joints] the header stamp of each joint's sample
    new_timeline: bool = False  # the first query after stamps stepped back: frame ids may repeat older ones


@dataclass
class StreamStats:
    """What became of each frame of the first camera that was not queried, and more (the
    timeline's counts, runtime.timeline.TimelineCounts, and the queries' own)."""
    first_camera_frames: int = 0
    partial_history: int = 0              # queries with fewer frame times than the layout (history not there yet)
    frames_without_history: int = 0       # wait_for_history: its history frames were missing
    frames_without_sync: int = 0          # another camera has no frame within sync_slop_s
    frames_without_state: int = 0         # a joint has no sample within state_slop_s of the frame
    frames_without_instruction: int = 0   # no instruction yet
    frames_superseded: int = 0            # a newer frame's window completed with it (a late joint state)
    frames_settling: int = 0              # stamped before a timeline change settled (runtime/timeline.py)
    timeline_restarts: int = 0            # timeline changes: every input before was dropped
    joint_states_refused: int = 0         # malformed joint state messages skipped
    frames_refused: int = 0               # camera frames the node would drop (unstamped, a repeated stamp)
    old_timeline_dropped: int = 0         # a source's samples of the timeline before a step, once it joined the new one


class ObservationStream:
    """A bag's messages -> Observations, the way the node forms them: a decode loop feeding
    runtime.timeline.InputTimeline, which the node and the simulator feed too.

    Messages are taken in recorded order. After each frame and joint state, the newest complete
    window is formed from the frames and joint states received so far, exactly as the node
    forms one when its plan runs low; each window with a newer first-camera frame than the last
    one is a query (with the latest instruction). Frames of the first camera never queried are
    counted in stats by why; a timeline change restarts everything, as in the node. Joint states
    are reordered by name to `joint_names` (other joints are ignored)."""

    def __init__(self, bag: Bag, inputs: BagInputs, layout: WindowLayout, history_offset_s: float,
                 joint_names: Sequence[str] = JOINT_NAMES, instruction: Optional[str] = None, every: int = 1,
                 max_frames: Optional[int] = None, sync_slop_s: float = SYNC_SLOP_S,
                 state_slop_s: float = STATE_SLOP_S, wait_for_history: bool = False,
                 max_camera_rate_hz: float = MAX_CAMERA_RATE_HZ, state_sync: str = "frame"):
        if tuple(c.name for c in inputs.cameras) != tuple(layout.cameras):
            raise BagError(f"bag cameras {[c.name for c in inputs.cameras]} do not match the layout's {layout.cameras}")
        if inputs.instruction is None and instruction is None:
            raise BagError("no instruction: the bag has no instruction topic and none was given")
        self.bag, self.inputs, self.layout = bag, inputs, layout
        self.joint_names = tuple(joint_names)
        self.spec = WindowSpec.of(layout.frames, history_offset_s, sync_slop_s, state_slop_s, wait_for_history)
        # As many frames as the node's frame buffer keeps.
        self.capacity = frames_to_keep(layout.frames, history_offset_s, max_camera_rate_hz)
        self.state_sync = state_sync
        self.fixed_instruction = instruction
        self.every = max(1, every)
        self.max_frames = max_frames
        self._timeline = self._new_timeline()
        self._queries = StreamStats()            # the counts that are the stream's own
        self.last_wait: Optional[Wait] = None   # why the last window attempt failed
        self.last_refusal: Optional[str] = None  # why the last message dropped was dropped

    def _new_timeline(self) -> InputTimeline:
        return InputTimeline([c.name for c in self.inputs.cameras], self.joint_names, self.spec, self.capacity,
                             self.state_sync)

    @property
    def stats(self) -> StreamStats:
        counts = self._timeline.counts.as_dict()
        return StreamStats(**counts, partial_history=self._queries.partial_history,
                           frames_without_instruction=self._queries.frames_without_instruction)

    def __iter__(self) -> Iterator[BagFrame]:
        timeline = self._timeline = self._new_timeline()
        self._queries = StreamStats()
        camera_of = {c.topic: i for i, c in enumerate(self.inputs.cameras)}
        instruction = self.fixed_instruction
        queries = candidates = 0
        decoded = set()    # topics with a good message: a bad one after that is damage, not a wrong type
        for topic, msgtype, time_ns, raw in self.bag.messages(self.inputs.topics):
            try:
                msg = self.bag.deserialize(raw, msgtype, topic)
                image = decode_image(msg, topic) if topic in camera_of else None
            except BagError as err:
                if topic not in decoded:
                    raise
                self.bag.mark_damaged(str(err))
                break
            decoded.add(topic)
            if topic == self.inputs.instruction:
                instruction = msg.data
                continue
            stamp = stamp_ns(msg.header.stamp)
            try:
                if topic == self.inputs.joint_states:
                    timeline.add_joint_states(stamp, msg.name, msg.position, source=topic)
                else:
                    timeline.add_frame(camera_of[topic], stamp, image)
            except InputError as err:   # dropped, as the node drops it
                self.last_refusal = f"{topic}: {err}"
                continue
            picked = timeline.window()
            if isinstance(picked, Wait):
                self.last_wait = picked
                continue
            if not timeline.is_new(picked):
                continue
            timeline.take(picked)
            if instruction is None:
                self._queries.frames_without_instruction += 1
                continue
            candidates += 1
            if (candidates - 1) % self.every:
                continue
            self._queries.partial_history += picked.frame_times < self.layout.frames
            observation = Observation(images=[f.item for _, f in picked.frames], state=picked.state.astype(np.float32),
                                      instruction=instruction, stamp=picked.reference.stamp_ns / 1e9,
                                      frame_ids=picked.frame_ids)
            yield BagFrame(index=queries, observation=observation, log_time_ns=time_ns,
                           stamp_ns=picked.reference.stamp_ns, state_stamps_ns=picked.state_stamps_ns,
                           new_timeline=picked.new_timeline)
            queries += 1
            if self.max_frames is not None and queries >= self.max_frames:
                return
        timeline.finish()


def image_shape(bag: Bag, inputs: BagInputs) -> tuple[int, int]:
    """(height, width) shared by every camera of the bag (the engine takes one size)."""
    shapes = {}
    for camera in inputs.cameras:
        msg = bag.first_message(camera.topic)
        if msg is None:
            raise BagError(f"camera topic {camera.topic} has no readable message")
        shapes[camera.topic] = decode_image(msg, camera.topic).shape[:2]
    if len(set(shapes.values())) != 1:
        raise BagError(f"cameras have different image sizes {shapes}; the engine takes one size")
    return next(iter(shapes.values()))
