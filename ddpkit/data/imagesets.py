"""Image sets: one split of a data set as the training loop indexes it, read from the
MNIST-like IDX files or from an image folder (train/<class>/*, test/<class>/*), and fed either from
memory (one uint8 tensor on the device, indexed per step) or streamed by a DataLoader that
decodes each batch's files, for data that does not fit. Both feeds give the same pixels.

Also the per-batch image arithmetic that both feeds share: standardising and shifting."""

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ddpkit.data import staging
from ddpkit.data.staging import MNIST_LIKE, RAW_FILES, STATS_FILE, MNISTLike, cannot_read, data_lock, files_stamp, walk_readable
from ddpkit.distributed import Runtime
from ddpkit.files import replace_json
from ddpkit.launch import UsageError
from ddpkit.options import RunOptions

FEEDS = ("memory", "stream")
# Per-channel mean and standard deviation of each training set's pixels, on the 0-1 scale,
# keyed by the staged folder's name.
MNIST_STATS = {"MNIST": ((0.1307,), (0.3081,)), "MNISTSample": ((0.1307,), (0.3081,)),
               "FashionMNIST": ((0.2860,), (0.3530,))}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
# PIL modes without colour; a folder whose images all have one of them gets 1 channel.
GRAY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
SIXTEEN_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")
STATS_FORMAT = 1


# ----------------------------------------------------------------------------- the image set

@dataclass(frozen=True, eq=False)
class ImageSet:
    """One split of a data set, as the training loop and evaluation index it."""
    labels: torch.Tensor                     # int64 [N], on the training device
    images: torch.Tensor | None              # uint8 [N, C, H, W] on the training device when held in memory, else None
    reader: Dataset | None                   # when streamed: item i -> uint8 [C, H, W] CPU tensor (image i)
    classes: tuple[str, ...]                 # class names, index = label
    mean: tuple[float, ...]                  # per-channel mean of the training split's pixels, 0-1 scale
    std: tuple[float, ...]                   # per-channel standard deviation, same
    # In memory: the images with a black border of one pixel, made once; `images` is then a
    # view of its inside, so a shifted batch is one indexing of its windows (batches).
    padded: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if (self.images is None) == (self.reader is None):
            raise ValueError("an ImageSet holds either images (memory) or a reader (stream)")
        if self.images is not None:
            padded = F.pad(self.images, (1, 1, 1, 1))
            object.__setattr__(self, "padded", padded)
            object.__setattr__(self, "images", padded[:, :, 1:-1, 1:-1])

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def feed(self) -> str:
        return "memory" if self.images is not None else "stream"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        if self.images is not None:
            return tuple(self.images.shape[1:])
        return getattr(self.reader, "shape", None) or tuple(self.reader[0].shape)

    def batches(self, index_batches: list[torch.Tensor], device: torch.device, workers: int = 0,
                moves: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(uint8 [B, C, H, W] images, int64 [B] labels) on `device`, one batch per index tensor,
        in order; each image moved by `moves` when given ([2 or 3, N], indexed by image: pixels
        down and right in {-1, 0, 1}, then 1 where it is mirrored left to right: the recipe's
        epoch_moves). Held in memory, a batch is one indexing operation (and one mirroring):
        the labels and the moves are put in batch order once, up front."""
        sizes = [len(idx) for idx in index_batches]
        order = torch.cat(index_batches) if index_batches else torch.zeros(0, dtype=torch.int64, device=self.labels.device)
        labels = self.labels[order.to(self.labels.device)].to(device).split(sizes)
        if self.images is not None:
            order = order.to(self.images.device)
            if moves is None:
                yield from zip((self.images[idx].to(device) for idx in order.split(sizes)), labels, strict=True)
                return
            # Every image's 3 x 3 neighbourhood of windows, as views of the padded images: a
            # batch is the window each of its images moves to.
            _, _, h, w = self.images.shape
            windows = self.padded.unfold(2, h, 1).unfold(3, w, 1)  # [N, C, 3, 3, h, w]
            targets = (1 - moves[:2, order.to(moves.device)]).to(self.images.device)  # [2, images]: window row, column
            mirrored = moves[2, order.to(moves.device)].to(device).split(sizes) if len(moves) > 2 else [None] * len(sizes)
            for idx, row, col, flips, y in zip(order.split(sizes), targets[0].split(sizes), targets[1].split(sizes), mirrored,
                                               labels, strict=True):
                yield mirror_images(windows[idx, :, row, col].to(device), flips), y
            return
        # A generator of its own: the loader draws its workers' seeds from it, not from the
        # global one that dropout uses (a resumed run would draw once more and train differently).
        moves = None if moves is None else moves.to(device)  # (once: indexing CPU moves by device indices would wait on each batch)
        loader = DataLoader(self.reader, batch_sampler=[idx.tolist() for idx in index_batches], num_workers=workers,
                            pin_memory=device.type == "cuda", generator=torch.Generator())
        try:
            for idx, batch, y in zip(index_batches, loader, labels, strict=True):
                batch = batch.to(device, non_blocking=True)
                yield (batch if moves is None else shift_images(batch, moves[:, idx.to(moves.device)].to(device))), y
        except UsageError as err:
            raise UsageError(_worker_message(err)) from None

    def pictures(self, indices: torch.Tensor) -> torch.Tensor:
        """uint8 [k, C, H, W] CPU images for these indices (for TensorBoard), either feed."""
        if self.images is not None:
            return self.images[indices.to(self.images.device)].cpu()
        if not len(indices):
            return torch.zeros((0, *self.shape), dtype=torch.uint8)
        return torch.stack([self.reader[i] for i in indices.tolist()])


def _worker_message(err: UsageError) -> str:
    """The one-line message of a UsageError raised in a DataLoader worker: torch re-raises it
    with the worker's whole traceback as its text (torch/utils/_utils.py, ExceptionWrapper),
    whose last line is 'ddpkit.launch.UsageError: <message>'."""
    last = (str(err).strip().splitlines() or [""])[-1]
    return last.partition("UsageError: ")[2] or str(err)


class TensorReader(Dataset):
    """Image i of a split already in (CPU) memory: the streamed feed of the MNIST-like sets."""

    def __init__(self, images: torch.Tensor):
        self.images = images
        self.shape = tuple(images.shape[1:])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.images[i]


class FolderReader(Dataset):
    """Image i of an image folder's split, decoded from its file when asked for. It holds only
    paths, so it pickles small for DataLoader workers."""

    def __init__(self, paths: list[str], shape: tuple[int, int, int]):
        self.paths, self.shape = paths, shape

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return decode_image(self.paths[i], self.shape)


# ----------------------------------------------------------------------------- reading a data set

def stage(options: RunOptions, dataset: str, rt: Runtime) -> Path:
    """staging.stage, with --download-only of an image folder reading it as training would
    (its layout, every header, its statistics measured and cached once); returns the
    directory every rank reads the data from."""
    return staging.stage(options, dataset, rt, check_folder=read_folder)


def read_splits(dataset: str, data_dir: Path, wanted: str, rt: Runtime, ranks_on_node: int) -> tuple[ImageSet, ImageSet]:
    """(train, test) of --dataset (a name of staging.DATASET_CLASSES, or "folder") staged in
    data_dir, fed as --data-feed `wanted` says (each rank decides; the first of each node says how)."""
    if dataset == "folder":
        listing, facts = read_folder(data_dir, verbose=rt.is_main, rt=rt)
        size, load = folder_bytes(listing, facts), functools.partial(folder_image_sets, listing, facts)
    else:
        spec = MNIST_LIKE[dataset]
        size, load = mnist_like_bytes(spec, data_dir), functools.partial(load_mnist_like, spec, data_dir)
    feed, reason = choose_feed(wanted, size, ranks_on_node, rt.device)
    if rt.local_rank == 0:
        print(f"[rank {rt.rank}] data: {reason}", flush=True)
    train, test = load(feed=feed, device=rt.device)
    # Each rank takes an equal share of the training images every epoch (and drops the rest).
    if len(train) < rt.world_size:
        raise UsageError(f"{len(train)} training image(s) in {data_dir} cannot be shared among {rt.world_size} ranks: every "
                         f"rank needs at least one; add training images, or run {len(train)} rank(s) at most")
    return train, test


def image_shape(dataset: str, data_dir: Path) -> tuple[tuple[int, int, int], int]:
    """((C, H, W), classes) of --dataset's images without reading them (for --check): an
    MNIST-like set's are known; a folder's shape is its cached one, else its first training
    image's (1 channel when it is grayscale), its classes its class folders."""
    if dataset in MNIST_LIKE:
        return (1, 28, 28), len(MNIST_LIKE[dataset].classes)
    if dataset != "folder":
        raise UsageError(f"--check knows the images of --dataset {', '.join(MNIST_LIKE)} and folder, not of "
                         f"{dataset or 'a recipe without --dataset'}: give kit.StepParts an image_shape for them "
                         "(docs/adapt.md)")
    listing = list_folder(data_dir)
    if facts := read_stats_cache(data_dir, listing.fingerprint):
        return facts.shape, len(listing.classes)
    (width, height), mode = read_header(listing.train[0][0])
    return (1 if mode in GRAY_MODES else 3, height, width), len(listing.classes)


# ----------------------------------------------------------------------------- choosing the feed

def choose_feed(wanted: str, image_bytes: int, ranks_on_node: int, device: torch.device) -> tuple[str, str]:
    """("memory" or "stream", a short reason for the log). `image_bytes` is one rank's copy of
    both splits as uint8; every rank on the node holds its own, on the CPU while loading."""
    if wanted in FEEDS:
        return wanted, f"{'held in memory' if wanted == 'memory' else 'streamed'} (--data-feed {wanted})"
    if wanted != "auto":
        raise ValueError(f"data feed {wanted!r} is not one of auto, {', '.join(FEEDS)}")
    need = f"{ranks_on_node} x {human_bytes(image_bytes)}"
    available = available_memory()
    if available is not None and image_bytes * ranks_on_node > available / 2:
        return "stream", f"streamed by a DataLoader: {need} would not fit in {human_bytes(available / 2)} (half the memory available)"
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if image_bytes > free / 4:
            return "stream", (f"streamed by a DataLoader: {human_bytes(image_bytes)} would not fit in {human_bytes(free / 4)} "
                              f"(a quarter of {device}'s free memory)")
    if available is None:
        return "memory", f"held in memory: {need} (the memory available is unknown)"
    return "memory", f"held in memory: {need} fit in {human_bytes(available / 2)} (half the memory available)"


def check_feed(feed: str) -> None:
    if feed not in FEEDS:
        raise ValueError(f"feed {feed!r} is not one of {', '.join(FEEDS)} (choose_feed resolves auto)")


def available_memory() -> int | None:
    """MemAvailable in bytes (what can be allocated without swapping), or None if unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def human_bytes(n: float) -> str:
    """188 MB, 30.2 GB: decimal units, three significant figures."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 999.5:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


# ----------------------------------------------------------------------------- MNIST-like sets

def mnist_like_bytes(spec: MNISTLike, data_dir: Path) -> int:
    """uint8 bytes of both splits' images, from the staged IDX files' sizes (16-byte headers)."""
    return sum((spec.raw(data_dir) / name).stat().st_size - 16 for name in RAW_FILES if "images" in name)


def load_mnist_like(spec: MNISTLike, data_dir: Path, feed: str, device: torch.device) -> tuple[ImageSet, ImageSet]:
    """(train, test) of an MNIST-like data set staged in DATA_DIR/<Name>/raw."""
    check_feed(feed)
    raw = spec.raw(data_dir)
    try:
        train_images, train_labels, test_images, test_labels = (read_idx(raw / name) for name in RAW_FILES)
        for images, labels in ((train_images, train_labels), (test_images, test_labels)):
            if images.dim() != 3 or labels.dim() != 1 or len(images) != len(labels):
                raise ValueError(f"{len(images)} images of {list(images.shape[1:])} and {len(labels)} labels")
        for name, labels in ((RAW_FILES[1], train_labels), (RAW_FILES[3], test_labels)):
            if len(labels) and labels.max() >= len(spec.classes):
                raise ValueError(f"{name} holds label {labels.max().item()}, but {spec.name} has only the "
                                 f"{len(spec.classes)} classes 0 to {len(spec.classes) - 1}")
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read {raw} ({type(err).__name__}: {err}); delete that folder and run again to fetch "
                         "it anew") from None
    mean, std = MNIST_STATS.get(spec.name) or stats_from_histograms(channel_histograms(train_images.unsqueeze(1)))

    def image_set(images: torch.Tensor, labels: torch.Tensor) -> ImageSet:
        images, labels = images.unsqueeze(1).contiguous(), labels.long()  # [N, 1, 28, 28]
        if feed == "memory":
            return ImageSet(labels.to(device), images.to(device), None, spec.classes, mean, std)
        return ImageSet(labels.to(device), None, TensorReader(images), spec.classes, mean, std)

    return image_set(train_images, train_labels), image_set(test_images, test_labels)


def read_idx(path: Path) -> torch.Tensor:
    """An unsigned-byte IDX file (the MNIST format): a 4-byte magic number 0x0000080D, whose
    last byte D is the number of dimensions, D big-endian 4-byte sizes, then the bytes."""
    data = path.read_bytes()
    if len(data) < 4 or data[:3] != b"\0\0\x08":
        raise ValueError(f"{path.name} is not an unsigned-byte IDX file")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * k: 8 + 4 * k], "big") for k in range(dims)]
    start = 4 + 4 * dims
    if len(data) != start + math.prod(shape):
        raise ValueError(f"{path.name} holds {len(data) - start} bytes after its header, not the {math.prod(shape)} of "
                         f"{shape}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=start).view(shape)


# ----------------------------------------------------------------------------- image folders

@dataclass(frozen=True)
class FolderListing:
    """The image files of a folder data set, in a fixed order every rank agrees on."""
    classes: tuple[str, ...]
    train: list[tuple[str, int]]     # (path, label)
    test: list[tuple[str, int]]
    fingerprint: str                 # hash of every image's relative path, size and mtime
    ignored: list[str]               # files that are not PNG or JPEG


@dataclass(frozen=True)
class FolderFacts:
    """What reading every header and every training pixel once finds out (and the cache holds),
    every test image checked whole along the way (check_headers): a later start whose files
    have the same fingerprint reads nothing but the cache."""
    shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def read_folder(root: Path, verbose: bool = True, rt: Runtime | None = None) -> tuple[FolderListing, FolderFacts]:
    """The images of ROOT/train/<class>/* and ROOT/test/<class>/* (PNG and JPEG, all of one
    size), and their shape and statistics (cached, or measured once). `verbose` (say, rank 0
    only) prints the warnings and the one-off statistics line; `rt`'s --dist-timeout bounds
    the wait for the data lock."""
    listing = list_folder(root)
    if listing.ignored and verbose:
        print(f"warning: ignored {len(listing.ignored)} file(s) in {root} that are not PNG or JPEG, e.g. "
              f"{listing.ignored[0]}", file=sys.stderr, flush=True)
    return listing, folder_facts(root, listing, verbose, rt)


def folder_bytes(listing: FolderListing, facts: FolderFacts) -> int:
    """uint8 bytes of both splits' images, for choose_feed before the images are read."""
    return (len(listing.train) + len(listing.test)) * math.prod(facts.shape)


def folder_image_sets(listing: FolderListing, facts: FolderFacts, feed: str,
                      device: torch.device) -> tuple[ImageSet, ImageSet]:
    """(train, test) of a read folder, decoded into memory or streamed from the files."""
    check_feed(feed)

    def image_set(files: list[tuple[str, int]]) -> ImageSet:
        labels = torch.tensor([label for _, label in files], dtype=torch.int64, device=device)
        reader = FolderReader([path for path, _ in files], facts.shape)
        if feed == "memory":
            return ImageSet(labels, decode_all(reader).to(device), None, listing.classes, facts.mean, facts.std)
        return ImageSet(labels, None, reader, listing.classes, facts.mean, facts.std)

    return image_set(listing.train), image_set(listing.test)


def layout_hint(root: Path) -> str:
    return f"--dataset folder reads {root}/train/<class>/*.png|jpg and {root}/test/<class>/*"


def list_folder(root: Path) -> FolderListing:
    """Every image of train/ and test/, labelled by its class folder, with the layout checked."""
    if not root.is_dir():
        raise UsageError(f"--data-dir {root} {'is not a folder' if root.exists() else 'does not exist'}: "
                         f"{layout_hint(root)}")
    for part in ("train", "test"):
        if not (root / part).is_dir():
            raise UsageError(f"--data-dir {root} has no {part}/ folder: {layout_hint(root)}")
    ignored: list[str] = []
    train_classes = class_files(root / "train", ignored)
    if not train_classes:
        raise UsageError(f"{root / 'train'} has no class folders: {layout_hint(root)}")
    classes = tuple(train_classes)
    train, test = [], []
    for label, (name, found) in enumerate(train_classes.items()):
        if not found:
            raise UsageError(f"{root / 'train' / name} holds no PNG or JPEG images: add some, or remove the folder to drop "
                             "the class")
        train += [(path, label) for path in found]
    for name, found in class_files(root / "test", ignored).items():
        if name not in classes:
            raise UsageError(f"{root / 'test' / name} is a class that {root / 'train'} lacks: add {root / 'train' / name} "
                             "with training images, or remove it")
        test += [(path, classes.index(name)) for path in found]
    if not test:
        raise UsageError(f"{root / 'test'} holds no PNG or JPEG images: put the test images in {root}/test/<class>/")
    fingerprint = files_stamp([path for path, _ in train + test], root)
    return FolderListing(classes, train, test, fingerprint, ignored)


def class_files(split_dir: Path, ignored: list[str]) -> dict[str, list[str]]:
    """{class folder's name: its PNG and JPEG files, in its subfolders too}, classes sorted by
    name, as torchvision's ImageFolder finds them; other files are noted in `ignored`. The
    split is walked once (staging.walk_readable), so a link from one class into another, or
    back up, is refused rather than counting images twice."""
    folders, files = walk_readable(split_dir)
    top = str(split_dir)
    found: dict[str, list[str]] = {folder[len(top) + 1:]: [] for folder in folders[1:]
                                   if os.sep not in folder[len(top) + 1:]}
    for path in files:
        name, inside, _ = path[len(top) + 1:].partition(os.sep)
        (found[name] if inside and path.lower().endswith(IMAGE_SUFFIXES) else ignored).append(path)
    return found


def read_header(path: str, verify: bool = False) -> tuple[tuple[int, int], str]:
    """(width, height) and PIL mode, from the file's header only; with `verify`, PIL's check
    of the whole file too (a PNG's every chunk against its CRC, which finds a truncated or
    damaged file; a JPEG's header only), at about the cost of reading it."""
    try:
        with Image.open(path) as image:
            size, mode = image.size, image.mode
            if verify:
                image.verify()
            return size, mode
    except PermissionError as err:
        raise cannot_read(path, err) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UsageError(f"cannot read {path} as an image ({type(err).__name__}: {err}); remove or replace it") from None


def check_headers(listing: FolderListing) -> tuple[int, int, int]:
    """(C, H, W) shared by every image: 1 channel if all are grayscale, else 3. Refuses an
    image of another size than the first (they are not resized: that would change the data).

    The test images are checked whole too (verify): streamed, one is decoded only at the
    first evaluation, after a whole epoch. The training images need no such check: the
    statistics decode every one of them next. Both run only when the statistics are measured."""
    paths = [path for path, _ in listing.train + listing.test]
    verify = [False] * len(listing.train) + [True] * len(listing.test)
    with ThreadPoolExecutor(decode_threads()) as pool:  # threads hide the latency of network file systems
        headers = list(pool.map(read_header, paths, verify))
    (width, height), _ = headers[0]
    for path, (size, _) in zip(paths, headers, strict=True):
        if size != (width, height):
            raise UsageError(f"{path} is {size[0]}x{size[1]} but {paths[0]} is {width}x{height}: every image must have one "
                             f"size; resize them first (e.g. with Pillow or ImageMagick's mogrify -resize {width}x{height}!)")
    channels = 1 if all(mode in GRAY_MODES for _, mode in headers) else 3
    return channels, height, width


def decode_image(path: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """uint8 [C, H, W]: the file's pixels as grayscale (C = 1) or RGB (C = 3)."""
    try:
        with Image.open(path) as image:
            if image.mode in SIXTEEN_BIT_MODES:
                # PIL's convert("L") clips 16-bit values at 255, which turns most of an image white.
                image = Image.fromarray((np.array(image).astype(np.int64).clip(0, 65535) >> 8).astype(np.uint8))
            pixels = np.array(image.convert("L" if shape[0] == 1 else "RGB"))
    except PermissionError as err:
        raise cannot_read(path, err) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UsageError(f"cannot decode {path} ({type(err).__name__}: {err}); remove or replace it") from None
    if pixels.shape[:2] != shape[1:]:
        raise UsageError(f"{path} is {pixels.shape[1]}x{pixels.shape[0]} but the other images are {shape[2]}x{shape[1]}: "
                         f"every image must have one size; resize it first (e.g. with mogrify -resize {shape[2]}x{shape[1]}!)")
    return torch.from_numpy(pixels.reshape(*shape[1:], shape[0])).permute(2, 0, 1).contiguous()


def decode_threads() -> int:
    """Threads for decoding (PIL releases the GIL): this rank's share of the CPUs, which the
    launcher set as torch's thread count."""
    return max(1, torch.get_num_threads())


def decode_chunks(reader: FolderReader, chunk: int = 1024) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, uint8 [k, C, H, W]) for consecutive chunks of the reader's images, decoded by threads."""
    with ThreadPoolExecutor(decode_threads()) as pool:
        for start in range(0, len(reader), chunk):
            yield start, torch.stack(list(pool.map(reader.__getitem__, range(start, min(start + chunk, len(reader))))))


def decode_all(reader: FolderReader) -> torch.Tensor:
    images = torch.empty((len(reader), *reader.shape), dtype=torch.uint8)
    for start, part in decode_chunks(reader):
        images[start: start + len(part)] = part
    return images


# ----------------------------------------------------------------------------- pixel statistics

def channel_histograms(images: torch.Tensor) -> torch.Tensor:
    """int64 [C, 256]: how many pixels of each channel have each value. Counts are exact, so
    the statistics do not depend on how the images were chunked."""
    return torch.stack([torch.bincount(images[:, c].reshape(-1), minlength=256) for c in range(images.shape[1])])


def stats_from_histograms(histograms: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) standard deviation on the 0-1 scale, from exact integer sums."""
    means, stds = [], []
    for counts in histograms.tolist():
        n = sum(counts)
        total = sum(v * c for v, c in enumerate(counts))
        squares = sum(v * v * c for v, c in enumerate(counts))
        means.append(total / n / 255)
        # A channel that never varies (all blue 0) would divide by 0: one pixel step instead.
        stds.append(max(math.sqrt(squares * n - total * total) / n / 255, 1 / 255))
    return tuple(means), tuple(stds)


def measure_pixels(reader: FolderReader) -> tuple[tuple[float, ...], tuple[float, ...]]:
    histograms = torch.zeros((reader.shape[0], 256), dtype=torch.int64)
    for _, part in decode_chunks(reader):
        histograms += channel_histograms(part)
    return stats_from_histograms(histograms)


def read_stats_cache(root: Path, fingerprint: str) -> FolderFacts | None:
    """The cached facts when they were measured on exactly these files, else None."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads((root / STATS_FILE).read_text())
        # Only a cache that says the images were checked spares a start their check.
        if saved["format"] == STATS_FORMAT and saved["fingerprint"] == fingerprint and saved["images_checked"] is True:
            return FolderFacts(tuple(saved["shape"]), tuple(saved["mean"]), tuple(saved["std"]))
    return None


def write_stats_cache(root: Path, fingerprint: str, facts: FolderFacts) -> str:
    """Write the cache atomically (a reader never sees half of it); "" or why it failed."""
    try:
        replace_json(root / STATS_FILE, {"format": STATS_FORMAT, "fingerprint": fingerprint, "images_checked": True,
                                         "shape": facts.shape, "mean": facts.mean, "std": facts.std})
    except OSError as err:
        return err.strerror or str(err)
    return ""


def folder_facts(root: Path, listing: FolderListing, verbose: bool, rt: Runtime | None = None) -> FolderFacts:
    """Shape and pixel statistics: from the cache, else measured once and cached, under the
    data lock so that the ranks and jobs sharing the folder measure it only once."""
    if facts := read_stats_cache(root, listing.fingerprint):
        return facts
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(data_lock(root, rt=rt))
            problem = ""
        except UsageError:  # a read-only folder still trains; it only cannot remember the statistics
            problem = f"cannot write to {root}"
        if not problem and (facts := read_stats_cache(root, listing.fingerprint)):
            return facts  # another rank or job measured it while this one waited for the lock
        shape = check_headers(listing)
        if verbose:
            where = "" if problem else f" (once: cached in {root / STATS_FILE})"
            print(f"measuring the pixels of the {len(listing.train)} training images in {root}{where}", flush=True)
        facts = FolderFacts(shape, *measure_pixels(FolderReader([path for path, _ in listing.train], shape)))
        problem = problem or write_stats_cache(root, listing.fingerprint, facts)
    if problem and verbose:
        print(f"warning: cannot cache the pixel statistics in {root / STATS_FILE} ({problem}); every start measures "
              "them anew", file=sys.stderr, flush=True)
    return facts


# ----------------------------------------------------------------------------- per-batch arithmetic

def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], channels_last: bool = False) -> torch.Tensor:
    """uint8 [B, C, H, W] -> float [B, C, H, W], standardised per channel on the images' device,
    in two operations (a training step runs this once; kernel launches add up on a GPU).

    One channel is shifted and scaled by Python numbers, as it always was: dividing by a
    tensor instead would round differently on CUDA, which divides by a CPU scalar as a
    multiplication by its reciprocal (div_true_kernel_cuda). Several channels take their
    numbers from two small tensors, made once per device."""
    if len(mean) == 1:
        offset, scale = 255 * mean[0], 255 * std[0]
    else:
        offset, scale = channel_constants(mean, std, images.device)
    x = torch.sub(images, offset).div_(scale)  # (uint8 minus a float: float32)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@functools.cache
def channel_constants(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """255 x mean and 255 x std as [1, C, 1, 1] float32 tensors on `device`."""
    return tuple(torch.tensor([255 * v for v in values], device=device).view(1, -1, 1, 1) for values in (mean, std))


def shift_images(images: torch.Tensor, moves: torch.Tensor | None) -> torch.Tensor:
    """uint8 [B, C, H, W] moved by [2 or 3, B] moves: pixels (down, right) in {-1, 0, 1}, the
    uncovered edge black, then mirrored left to right where the third row is 1."""
    if moves is None:
        return images
    b, _, h, w = images.shape
    windows = F.pad(images, (1, 1, 1, 1)).unfold(2, h, 1).unfold(3, w, 1)  # [B, C, 3, 3, h, w], views of the padded batch
    # The two index tensors around the slice put the batch dimension first: [B, C, h, w].
    shifted = windows[torch.arange(b, device=images.device), :, 1 - moves[0], 1 - moves[1]]
    return mirror_images(shifted, moves[2] if len(moves) > 2 else None)


def mirror_images(images: torch.Tensor, mirrored: torch.Tensor | None) -> torch.Tensor:
    """[B, C, H, W] images, those where `mirrored` ([B], 0 or 1) is 1 mirrored left to right
    (None: none of them)."""
    if mirrored is None:
        return images
    return torch.where(mirrored.view(-1, 1, 1, 1).bool(), images.flip(3), images)
