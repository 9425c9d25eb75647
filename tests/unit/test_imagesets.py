"""ddpkit/data/imagesets.py on real files: image folders written with PIL into tmp_path, the
bundled MNIST sample staged as the script stages it, real DataLoaders with real worker
processes, and a folder that is read-only for real (a read-only bind mount in a private
mount namespace). It proves that the streamed feed gives bit for bit the pixels of the
in-memory feed, that the pixel statistics are right, cached, reused and renewed, that
every bad folder is refused in one line that names the file, and that the per-batch
arithmetic moved here from mnist_ddp.py gives today's results bit for bit.

    python -m pytest tests/unit/test_imagesets.py -q
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ddpkit.data.imagesets import (
    STATS_FILE,
    ImageSet,
    choose_feed,
    folder_bytes,
    folder_image_sets,
    human_bytes,
    list_folder,
    load_mnist_like,
    normalize,
    read_folder,
    read_splits,
    shift_images,
)
from ddpkit.data.staging import MNIST_SAMPLE, stage_dataset
from ddpkit.distributed import Runtime
from ddpkit.launch import UsageError
from helpers.processes import ROOT, clean_env

CPU = torch.device("cpu")
ONE = Runtime(0, 0, 1, CPU, "none", True)
CLASSES = ("ant", "bee", "cat")


def class_pattern(label: int, seed: int, size: tuple[int, int] = (32, 32)) -> np.ndarray:
    """uint8 [H, W, 3]: noise with a bright band whose place and colour tell the class."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 120, (size[1], size[0], 3), dtype=np.uint8)
    pixels[:, 8 * label: 8 * label + 8, label] = 250
    return pixels


def write_folder(root: Path, classes=CLASSES, train: int = 4, test: int = 2, gray: bool = False) -> dict[str, np.ndarray]:
    """ROOT/train/<class>/ and ROOT/test/<class>/ of 32x32 PNG images (one JPEG per class in
    train/); returns the PNGs' pixels by path, to compare with what is read."""
    written = {}
    for part, count in (("train", train), ("test", test)):
        for label, name in enumerate(classes):
            (root / part / name).mkdir(parents=True, exist_ok=True)
            for k in range(count):
                pixels = class_pattern(label, seed=1000 * (part == "test") + 10 * label + k)
                image = Image.fromarray(pixels)
                if gray:
                    image = image.convert("L")
                if part == "train" and k == count - 1:
                    image.save(root / part / name / f"{k}.JPG", quality=90)
                    continue
                image.save(root / part / name / f"{k}.png")
                written[str(root / part / name / f"{k}.png")] = np.array(image)
    return written


def train_pixels(root: Path, gray: bool = False) -> np.ndarray:
    """float64 [N, C, H, W] on the 0-1 scale: every training image decoded by PIL directly."""
    images = [np.array(Image.open(path).convert("L" if gray else "RGB"), dtype=np.float64)
              for path in sorted((root / "train").rglob("*")) if path.is_file() and not path.name.startswith(".")]
    stacked = np.stack(images)
    return (stacked[:, None] if gray else stacked.transpose(0, 3, 1, 2)) / 255


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "pictures"
    write_folder(root)
    return root


def index_batches(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return list(order.split(size))


def load_folder(root: Path, feed: str) -> tuple[ImageSet, ImageSet]:
    """(train, test) of the image folder `root`, read as a run of one process reads it, fed as `feed` says."""
    return read_splits("folder", root, feed, ONE, 1)


def one_line_refusal(root: Path) -> str:
    with pytest.raises(UsageError) as refused:
        load_folder(root, "memory")
    message = str(refused.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- both feeds alike

@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_batches_are_the_in_memory_batches(folder, workers):
    """The DataLoader path, with and without worker processes, yields exactly the tensor
    that indexing the in-memory images gives, for the same index batches."""
    held, _ = load_folder(folder, "memory")
    streamed, _ = load_folder(folder, "stream")
    assert (held.feed, streamed.feed) == ("memory", "stream")
    assert held.shape == streamed.shape == (3, 32, 32)
    assert len(held) == len(streamed) == 12
    assert torch.equal(held.labels, streamed.labels)
    assert (held.mean, held.std, held.classes) == (streamed.mean, streamed.std, streamed.classes)
    batches = index_batches(len(held), 5)
    for idx, (from_memory, labels), (from_files, streamed_labels) in zip(
            batches, held.batches(batches, CPU), streamed.batches(batches, CPU, workers), strict=True):
        assert from_files.dtype == torch.uint8 and from_files.shape == (len(idx), 3, 32, 32)
        assert torch.equal(from_memory, from_files)
        assert torch.equal(from_memory, held.images[idx])
        assert torch.equal(labels, held.labels[idx]) and torch.equal(streamed_labels, labels)
    # Moved, and moved and mirrored: the same pixels either way, each image's move its own
    # (moves are indexed by image).
    shifts = torch.randint(-1, 2, (2, len(held)), generator=torch.Generator().manual_seed(3))
    mirrored = torch.tensor([[1, 0] * (len(held) // 2)])
    for moves in (shifts, torch.cat([shifts, mirrored])):
        for idx, (from_memory, _), (from_files, _) in zip(
                batches, held.batches(batches, CPU, moves=moves), streamed.batches(batches, CPU, workers, moves=moves),
                strict=True):
            assert torch.equal(from_memory, from_files)
            assert torch.equal(from_memory, shift_images(held.images[idx], moves[:, idx]))
    # Mirrored: the shifted image's columns in reverse order, where the third row says so.
    mirrored_batch = shift_images(held.images, torch.cat([shifts, mirrored]))
    assert torch.equal(mirrored_batch[0], shift_images(held.images, shifts)[0].flip(2))
    assert torch.equal(mirrored_batch[1], shift_images(held.images, shifts)[1])


def test_pixels_are_the_files_pixels_in_channel_first_order(tmp_path):
    written = write_folder(tmp_path)
    train, test = load_folder(tmp_path, "memory")
    assert train.classes == CLASSES
    # Class folders in name order, files in name order within each.
    assert train.labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert torch.equal(train.images[0], torch.from_numpy(written[str(tmp_path / "train/ant/0.png")]).permute(2, 0, 1))
    assert torch.equal(test.images[5], torch.from_numpy(written[str(tmp_path / "test/cat/1.png")]).permute(2, 0, 1))


def test_pictures_from_either_feed(folder):
    held, _ = load_folder(folder, "memory")
    streamed, _ = load_folder(folder, "stream")
    wanted = torch.tensor([7, 0, 3])
    for image_set in (held, streamed):
        pictures = image_set.pictures(wanted)
        assert pictures.device == CPU and pictures.dtype == torch.uint8
        assert torch.equal(pictures, held.images[wanted])
        assert image_set.pictures(torch.zeros(0, dtype=torch.int64)).shape == (0, 3, 32, 32)


def test_image_set_holds_images_or_a_reader_not_both():
    with pytest.raises(ValueError):
        ImageSet(torch.zeros(1, dtype=torch.int64), None, None, ("a",), (0.5,), (0.5,))


# ----------------------------------------------------------------------------- channels

def test_grayscale_folder_gets_one_channel(tmp_path):
    """PNG and JPEG in L, a 1-bit PNG and a 16-bit PNG: all grayscale, so one channel; the
    16-bit image keeps its top 8 bits rather than being clipped to white."""
    write_folder(tmp_path, gray=True)
    Image.new("1", (32, 32), 1).save(tmp_path / "train/ant/bits.png")
    deep = (np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64)
    Image.fromarray(deep).save(tmp_path / "train/bee/deep.png")
    assert Image.open(tmp_path / "train/bee/deep.png").mode == "I;16"
    train, _ = load_folder(tmp_path, "memory")
    assert train.shape == (1, 32, 32) and len(train.mean) == len(train.std) == 1
    streamed, _ = load_folder(tmp_path, "stream")
    index = streamed.reader.paths.index(str(tmp_path / "train/bee/deep.png"))
    assert torch.equal(train.images[index, 0], torch.from_numpy((deep >> 8).astype(np.uint8)))
    assert train.images[streamed.reader.paths.index(str(tmp_path / "train/ant/bits.png"))].eq(255).all()


def test_one_colour_image_makes_three_channels(tmp_path):
    write_folder(tmp_path, gray=True)
    Image.fromarray(class_pattern(0, seed=1)).save(tmp_path / "test/ant/colour.png")
    train, test = load_folder(tmp_path, "memory")
    assert train.shape == test.shape == (3, 32, 32)
    gray = train.images[0]
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])


# ----------------------------------------------------------------------------- statistics

def test_statistics_are_measured_cached_reused_and_renewed(tmp_path):
    write_folder(tmp_path)
    train, test = load_folder(tmp_path, "stream")
    pixels = train_pixels(tmp_path)
    np.testing.assert_allclose(train.mean, pixels.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(train.std, pixels.std(axis=(0, 2, 3)), rtol=1e-12)
    assert (test.mean, test.std) == (train.mean, train.std)  # the test split is standardised like the training split

    cache = tmp_path / STATS_FILE
    saved = json.loads(cache.read_text())
    assert saved["shape"] == [3, 32, 32] and tuple(saved["mean"]) == train.mean
    stamp = cache.stat().st_mtime_ns
    again, _ = load_folder(tmp_path, "memory")
    assert cache.stat().st_mtime_ns == stamp
    assert (again.mean, again.std) == (train.mean, train.std)
    assert folder_bytes(*read_folder(tmp_path)) == (12 + 6) * 3 * 32 * 32

    Image.fromarray(np.full((32, 32, 3), 255, dtype=np.uint8)).save(tmp_path / "train/bee/white.png")
    renewed, _ = load_folder(tmp_path, "memory")
    assert cache.stat().st_mtime_ns != stamp
    pixels = train_pixels(tmp_path)
    np.testing.assert_allclose(renewed.mean, pixels.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(renewed.std, pixels.std(axis=(0, 2, 3)), rtol=1e-12)
    assert renewed.mean[0] > train.mean[0]
    assert not list(tmp_path.glob(f"{STATS_FILE}.tmp-*"))


def test_a_later_start_on_an_unchanged_streamed_folder_opens_no_image(folder, monkeypatch):
    """The first start checks every image once, where it measures the statistics (a PNG's
    check reads it whole); a start (or requeue) whose files have the same fingerprint reads
    only the cache, and a streamed set opens no image before its first batch. PIL's
    Image.open is wrapped to count what each start opens."""
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda path, *args, **kwargs: opened.append(path) or real_open(path, *args, **kwargs))
    one = Runtime(0, 0, 1, CPU, "none", True)
    first, _ = read_splits("folder", folder, "stream", one, ranks_on_node=1)
    images = {str(path) for part in ("train", "test") for path in (folder / part).rglob("*.*")}
    assert first.feed == "stream" and set(map(str, opened)) == images and len(images) == 18
    opened.clear()
    again, _ = read_splits("folder", folder, "stream", one, ranks_on_node=1)
    assert again.feed == "stream" and (again.mean, again.std) == (first.mean, first.std)
    assert opened == []
    assert json.loads((folder / STATS_FILE).read_text())["images_checked"] is True


def test_read_only_folder_loads_with_one_warning(tmp_path):
    """Mounted read-only (as root, permissions alone would not stop the write): the
    statistics are measured without a cache, one warning says so, and the set loads."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a read-only bind mount")
    write_folder(tmp_path)
    expected, _ = load_folder(tmp_path, "memory")
    (tmp_path / STATS_FILE).unlink()
    code = ("import sys, torch; from pathlib import Path; from ddpkit.distributed import Runtime; "
            "from ddpkit.data.imagesets import read_splits; one = Runtime(0, 0, 1, torch.device('cpu'), 'none', True); "
            "train, test = read_splits('folder', Path(sys.argv[1]), 'stream', one, 1); "
            "print(len(train), len(test), train.shape, train.mean)")
    script = (f'mount --bind {tmp_path} {tmp_path} && mount -o remount,bind,ro {tmp_path} && '
              f'! touch {tmp_path}/probe 2>/dev/null && exec "$@"')
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                             sys.executable, "-c", code, str(tmp_path)],
                            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == f"12 6 (3, 32, 32) {expected.mean}"
    warnings = [line for line in result.stderr.splitlines() if line.strip()]
    assert warnings == [f"warning: cannot cache the pixel statistics in {tmp_path / STATS_FILE} (cannot write to "
                        f"{tmp_path}); every start measures them anew"]
    assert not (tmp_path / STATS_FILE).exists()


# ----------------------------------------------------------------------------- refusals

def test_folder_without_train_is_refused(folder):
    shutil.rmtree(folder / "train")
    assert one_line_refusal(folder) == (f"--data-dir {folder} has no train/ folder: --dataset folder reads "
                                        f"{folder}/train/<class>/*.png|jpg and {folder}/test/<class>/*")


def test_test_class_that_train_lacks_is_refused(folder):
    (folder / "test/dog").mkdir()
    Image.fromarray(class_pattern(0, seed=3)).save(folder / "test/dog/0.png")
    assert one_line_refusal(folder).startswith(f"{folder / 'test/dog'} is a class that {folder / 'train'} lacks")


def test_test_may_lack_a_class(folder):
    shutil.rmtree(folder / "test/bee")
    train, test = load_folder(folder, "memory")
    assert test.classes == CLASSES and test.labels.tolist() == [0, 0, 2, 2]
    with pytest.raises(ValueError):
        folder_image_sets(*read_folder(folder), "auto", CPU)  # (read_splits has choose_feed resolve auto first)


def test_image_of_another_size_is_refused(folder):
    Image.new("RGB", (40, 30)).save(folder / "train/cat/x.png")
    assert one_line_refusal(folder) == (
        f"{folder / 'train/cat/x.png'} is 40x30 but {folder / 'train/ant/0.png'} is 32x32: every image must have one size; "
        "resize them first (e.g. with Pillow or ImageMagick's mogrify -resize 32x32!)")


def test_file_that_is_not_an_image_is_refused(folder):
    (folder / "train/bee/broken.png").write_bytes(b"not a picture")
    message = one_line_refusal(folder)
    assert message.startswith(f"cannot read {folder / 'train/bee/broken.png'} as an image (UnidentifiedImageError")
    assert message.endswith("; remove or replace it")


def test_truncated_image_is_refused_when_decoded(folder):
    """Its header reads, its pixels do not: refused while measuring (training images), or
    when a DataLoader worker meets it (a test image, streamed), still in one line."""
    whole = (folder / "train/ant/1.png").read_bytes()
    (folder / "train/ant/1.png").write_bytes(whole[: len(whole) // 2])
    message = one_line_refusal(folder)
    assert message.startswith(f"cannot decode {folder / 'train/ant/1.png'} (") and message.endswith("remove or replace it")

    (folder / "train/ant/1.png").write_bytes(whole)
    _, test = load_folder(folder, "stream")
    whole = (folder / "test/bee/0.png").read_bytes()
    (folder / "test/bee/0.png").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UsageError) as refused:
        list(test.batches([torch.arange(len(test))], CPU, workers=2))
    assert str(refused.value).startswith(f"cannot decode {folder / 'test/bee/0.png'} (")
    assert "\n" not in str(refused.value)


def test_symlinked_files_and_folders_are_read_once_each(folder):
    """A class folder or an image may be a symlink to elsewhere: each counts once."""
    outside = folder.parent / "more-bees"
    outside.mkdir()
    Image.fromarray(class_pattern(1, seed=77)).save(outside / "extra.png")
    (folder / "train/bee/more").symlink_to(outside)
    (folder / "train/cat/linked.png").symlink_to(folder / "train/cat/0.png")
    train, _ = load_folder(folder, "memory")
    assert len(train) == 12 + 2 and train.labels.tolist().count(1) == 5


def test_listing_a_folder_stats_each_file_once_and_each_folder_and_symlink(folder, monkeypatch):
    """Every rank lists the folder at every start: on a parallel file system each metadata call
    costs a round trip to its server. A plain entry's type comes with the directory listing;
    only folders (for the loop check) and symlinks (to follow them) are stat'ed there, and
    the fingerprint stats each file once. os.stat and os.access are wrapped to count calls."""
    (folder / "train/bee/more").symlink_to(folder.parent / "more-bees", target_is_directory=True)
    (folder.parent / "more-bees").mkdir()
    Image.fromarray(class_pattern(1, seed=77)).save(folder.parent / "more-bees/extra.png")
    (folder / "train/cat/linked.png").symlink_to(folder / "train/cat/0.png")
    calls = {"stat": 0, "access": 0}
    real_stat, real_access = os.stat, os.access

    def counted_stat(*args, **kwargs):
        calls["stat"] += 1
        return real_stat(*args, **kwargs)

    def counted_access(*args, **kwargs):
        calls["access"] += 1
        return real_access(*args, **kwargs)

    monkeypatch.setattr(os, "stat", counted_stat)
    monkeypatch.setattr(os, "access", counted_access)
    listing = list_folder(folder)
    files, symlinks = len(listing.train) + len(listing.test), 2
    folders = 3 + (1 + 3 + 1) + (1 + 3)  # the layout's checks (root, train/, test/), then each folder walked:
    # train/ with its 3 classes and train/bee/more, test/ with its 3
    assert files == 12 + 6 + 2
    assert calls == {"stat": files + folders + symlinks, "access": 0}


def test_broken_symlink_in_a_class_folder_is_refused_by_name(folder):
    (folder / "train/bee/gone.png").symlink_to(folder / "elsewhere/gone.png")
    assert one_line_refusal(folder) == (f"{folder / 'train/bee/gone.png'} is a broken symlink (to "
                                        f"{folder / 'elsewhere/gone.png'}, which does not exist): remove it, or restore "
                                        "what it points to")


@pytest.mark.parametrize("target, again", [("..", "train"), ("../ant", "train/ant")])
def test_symlink_loop_or_a_second_link_to_a_folder_is_refused_not_counted_again(folder, target, again):
    """class/loop -> .. would read the split again and again until the path grows too long
    (300 images became 4,660); a link into another class would count its images under two
    labels. Both are refused, naming the link and the folder it leads to."""
    (folder / "train/bee/loop").symlink_to(target)
    assert one_line_refusal(folder) == (f"{folder / 'train/bee/loop'} leads to {folder / again} again (a symlink loop, or "
                                        "a second link to one folder), so its images would count twice: remove that link")


@pytest.mark.slow
def test_empty_class_folder_is_refused(folder):
    (folder / "train/dog").mkdir()
    (folder / "train/dog/notes.txt").write_text("to do")
    assert one_line_refusal(folder) == (f"{folder / 'train/dog'} holds no PNG or JPEG images: add some, or remove the "
                                        "folder to drop the class")


def test_other_files_are_ignored_with_one_warning_and_hidden_ones_silently(folder, capsys):
    (folder / "train/ant/notes.txt").write_text("ants")
    (folder / "test/README").write_text("test images")
    (folder / "train/.thumbnails").mkdir()
    Image.new("RGB", (8, 8)).save(folder / "train/.thumbnails/small.png")
    Image.new("RGB", (8, 8)).save(folder / "train/bee/.small.png")
    train, test = load_folder(folder, "memory")
    assert (len(train), len(test), train.classes) == (12, 6, CLASSES)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings == [f"warning: ignored 2 file(s) in {folder} that are not PNG or JPEG, e.g. {folder / 'train/ant/notes.txt'}"]


# ----------------------------------------------------------------------------- choosing the feed

def test_choose_feed():
    assert choose_feed("stream", 10, 1, CPU) == ("stream", "streamed (--data-feed stream)")
    assert choose_feed("memory", 10**15, 1, CPU) == ("memory", "held in memory (--data-feed memory)")
    feed, reason = choose_feed("auto", 188 * 10**6, 2, CPU)
    assert feed == "memory" and reason.startswith("held in memory: 2 x 188 MB fit in ")
    feed, reason = choose_feed("auto", 30_200 * 10**9, 4, CPU)
    assert feed == "stream" and reason.startswith("streamed by a DataLoader: 4 x 30.2 TB would not fit in ")
    assert [human_bytes(n) for n in (512, 47_040_000, 1.5e9)] == ["512 B", "47 MB", "1.5 GB"]
    with pytest.raises(ValueError):
        choose_feed("fast", 10, 1, CPU)


# ----------------------------------------------------------------------------- MNIST-like sets

@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory) -> Path:
    data_dir = tmp_path_factory.mktemp("data")
    stage_dataset(MNIST_SAMPLE, data_dir)
    return data_dir


def test_mnist_like_sample_in_either_feed(sample_dir):
    train, test = load_mnist_like(MNIST_SAMPLE, sample_dir, "memory", CPU)
    assert train.images.shape == (4000, 1, 28, 28) and test.images.shape == (1000, 1, 28, 28)
    assert train.labels.dtype == torch.int64 and len(train.classes) == 10 and train.classes[3] == "3 - three"
    assert (train.mean, train.std) == ((0.1307,), (0.3081,))
    streamed, streamed_test = load_mnist_like(MNIST_SAMPLE, sample_dir, "stream", CPU)
    assert streamed.shape == (1, 28, 28) and len(streamed_test) == 1000
    batches = index_batches(len(train), 500)
    for (a, labels_a), (b, labels_b) in zip(train.batches(batches, CPU), streamed.batches(batches, CPU, workers=2),
                                            strict=True):
        assert torch.equal(a, b) and torch.equal(labels_a, labels_b)
    assert torch.equal(streamed_test.pictures(torch.tensor([4, 2])), test.images[[4, 2]])


def test_damaged_mnist_like_files_are_refused(sample_dir, tmp_path):
    shutil.copytree(sample_dir / "MNISTSample", tmp_path / "MNISTSample")
    raw = tmp_path / "MNISTSample" / "raw"
    whole = (raw / "t10k-images-idx3-ubyte").read_bytes()
    (raw / "t10k-images-idx3-ubyte").write_bytes(whole[:1000])
    with pytest.raises(UsageError) as refused:
        load_mnist_like(MNIST_SAMPLE, tmp_path, "memory", CPU)
    assert str(refused.value).startswith(f"cannot read {raw} (")
    assert str(refused.value).endswith("); delete that folder and run again to fetch it anew")


def test_mnist_like_label_above_the_classes_is_refused_naming_the_file(sample_dir, tmp_path):
    """A label of 12 in a 10-class IDX file would index past the class names: refused when read."""
    shutil.copytree(sample_dir / "MNISTSample", tmp_path / "MNISTSample")
    labels = tmp_path / "MNISTSample" / "raw" / "t10k-labels-idx1-ubyte"
    data = bytearray(labels.read_bytes())
    data[8 + 5] = 12  # the sixth label, after the 8-byte header
    labels.write_bytes(bytes(data))
    with pytest.raises(UsageError) as refused:
        load_mnist_like(MNIST_SAMPLE, tmp_path, "stream", CPU)
    assert str(refused.value) == (f"cannot read {labels.parent} (ValueError: t10k-labels-idx1-ubyte holds label 12, but "
                                  "MNISTSample has only the 10 classes 0 to 9); delete that folder and run again to fetch "
                                  "it anew")


# ----------------------------------------------------------------------------- per-batch arithmetic

def shift_images_before(images: torch.Tensor, moves: torch.Tensor | None) -> torch.Tensor:
    """mnist_ddp.py's shift_images for uint8 [B, 28, 28], as it was before the move."""
    if moves is None:
        return images
    b, h, w = images.shape
    windows = F.pad(images, (1, 1, 1, 1)).unfold(1, h, 1).unfold(2, w, 1)
    return windows[torch.arange(b, device=images.device), 1 - moves[0], 1 - moves[1]]


def normalize_before(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """mnist_ddp.py's normalize for uint8 [B, 28, 28], as it was before the move."""
    return images.unsqueeze(1).float().sub_(255 * mean).div_(255 * std)


def test_shift_images_of_one_channel_is_the_old_shift():
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 28, 28), dtype=torch.uint8, generator=generator)
    moves = torch.randint(-1, 2, (2, 64), generator=generator)
    assert torch.equal(shift_images(images.unsqueeze(1), moves).squeeze(1), shift_images_before(images, moves))
    assert shift_images(images.unsqueeze(1), None).shape == (64, 1, 28, 28)


def test_shift_images_moves_every_channel_alike():
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (16, 3, 8, 10), dtype=torch.uint8, generator=generator)
    moves = torch.randint(-1, 2, (2, 16), generator=generator)
    shifted = shift_images(images, moves)
    assert shifted.shape == (16, 3, 8, 10)
    for c in range(3):
        assert torch.equal(shifted[:, c], shift_images_before(images[:, c].contiguous(), moves))
    down = shift_images(images[:1], torch.tensor([[1], [0]]))
    assert torch.equal(down[0, :, 1:], images[0, :, :-1]) and not down[0, :, 0].any()


def test_normalize_is_the_old_arithmetic_per_channel():
    generator = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (32, 28, 28), dtype=torch.uint8, generator=generator)
    assert torch.equal(normalize(images.unsqueeze(1), (0.1307,), (0.3081,)), normalize_before(images, 0.1307, 0.3081))
    colour = torch.randint(0, 256, (8, 3, 5, 5), dtype=torch.uint8, generator=generator)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    x = normalize(colour, mean, std, channels_last=True)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    for c in range(3):
        assert torch.equal(x[:, c], normalize_before(colour[:, c], mean[c], std[c])[:, 0])


def test_check_reads_the_shape_of_a_data_set_without_its_images_and_names_one_it_cannot(tmp_path):
    """--check's shape and class count: an MNIST-like set's are known, a folder's come from its
    first training image (1 x 8 x 8 grayscale here), and a --dataset of the recipe's own is
    refused in one line that says how to give its shape."""
    from ddpkit.data.imagesets import image_shape
    from helpers.images import make_image_folder

    assert image_shape("fashion-mnist", tmp_path) == ((1, 28, 28), 10)
    colour = make_image_folder(tmp_path / "colour", {"train": 1, "test": 1}, size=8)
    assert image_shape("folder", colour) == ((3, 8, 8), 3)
    gray = tmp_path / "gray"
    for part in ("train", "test"):
        (gray / part / "a").mkdir(parents=True)
        Image.new("L", (8, 6)).save(gray / part / "a" / "0.png")
    assert image_shape("folder", gray) == ((1, 6, 8), 1)
    with pytest.raises(UsageError, match=r"^--check knows the images of --dataset mnist-sample, mnist, fashion-mnist and "
                                         r"folder, not of cifar: give kit.StepParts an image_shape for them"):
        image_shape("cifar", tmp_path)
