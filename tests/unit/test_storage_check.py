"""ddpkit/run/storage_check.py, --check's look at LOG_DIR's and DATA_DIR's storage: the mount
that holds a path and its lock options, read from real /proc/self/mountinfo lines (NFS
mounted nolock, NFS local_lock=all and by default, Lustre localflock and flock, GPFS, ext4,
tmpfs, overlay, a mount point with a space), the lines rank 0 prints from what each node
saw (one a folder when the nodes agree, one a node when not, the line that says where locks
do not exclude and what covers it), and the probe itself with two real Gloo ranks posing
as two nodes on this host's file system, where a lock excludes. The check on three Slurm
nodes, one of whose locks exclude nothing: tests/cluster/mostly_waiting/test_check_on_three_nodes.py.

    python -m pytest tests/unit/test_storage_check.py
"""

import fcntl

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit.files import Mount, mount_of, parse_mountinfo
from ddpkit.run import storage_check
from ddpkit.run.storage_check import NodeView, StorageFolder, storage_lines

# Lines as the kernel writes them (the NFS ones from nfs_show_mount_options: a v3 mount with
# nolock also shows local_lock=all).
MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
25 24 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24684092k
44 27 0:40 / /home rw,relatime shared:30 - nfs fs01:/export/home rw,vers=3,rsize=1048576,wsize=1048576,namlen=255,hard,nolock,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=10.0.0.5,mountvers=3,mountport=20048,mountproto=udp,local_lock=all,addr=10.0.0.5
88 27 0:52 / /shared rw,relatime shared:45 - nfs4 nas:/shared rw,vers=4.2,rsize=1048576,wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.0.0.7,local_lock=all,addr=10.0.0.2
89 88 0:53 / /shared/projects rw,relatime shared:46 - nfs4 nas:/projects rw,vers=4.2,hard,noac,proto=tcp,lookupcache=none,local_lock=none,addr=10.0.0.2
120 27 0:60 / /lustre/scratch rw,relatime shared:70 - lustre 10.10.0.1@o2ib:10.10.0.2@o2ib:/scratch rw,localflock,lazystatfs
121 27 0:61 / /lustre/work rw,relatime shared:71 - lustre 10.10.0.1@o2ib:/work rw,flock,user_xattr,lazystatfs
150 27 0:70 / /gpfs/fs1 rw,relatime shared:80 - gpfs fs1 rw
160 27 8:17 / /mnt/my\040data rw,noatime - xfs /dev/sdb1 rw,attr2,inode64,noquota
"""


@pytest.mark.parametrize(("path", "words", "short"), [
    ("/home/ana/runs", "nfs fs01:/export/home on /home (nolock, local_lock=all)", "nfs, nolock, local_lock=all"),
    ("/shared/data", "nfs4 nas:/shared on /shared (local_lock=all)", "nfs4, local_lock=all"),
    ("/shared/projects/a", "nfs4 nas:/projects on /shared/projects (noac, lookupcache=none, local_lock=none)",
     "nfs4, noac, lookupcache=none, local_lock=none"),
    ("/lustre/scratch/u", "lustre 10.10.0.1@o2ib:10.10.0.2@o2ib:/scratch on /lustre/scratch (localflock)", "lustre, localflock"),
    ("/lustre/work", "lustre 10.10.0.1@o2ib:/work on /lustre/work (flock)", "lustre, flock"),
    ("/gpfs/fs1/runs", "gpfs fs1 on /gpfs/fs1", "gpfs"),
    ("/tmp/runs", "ext4 /dev/vda on /", "ext4"),
    ("/dev/shm/x", "tmpfs tmpfs on /dev/shm", "tmpfs"),
    ("/sharedfolder", "ext4 /dev/vda on /", "ext4"),  # (not under /shared: a mount point is a whole name)
    ("/mnt/my data/runs", "xfs /dev/sdb1 on /mnt/my data", "xfs"),
])
def test_the_mount_that_holds_a_path_and_its_lock_options(path, words, short):
    mount = mount_of(path, parse_mountinfo(MOUNTINFO))
    assert (mount.words(), mount.short()) == (words, short)


def test_a_later_mount_over_the_same_point_wins_and_an_overlay_root_is_read():
    text = ("27 1 254:0 / / rw - ext4 /dev/vda rw\n"
            "500 27 0:80 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n")
    assert mount_of("/work/runs", parse_mountinfo(text)) == Mount("/", "overlay", "overlay")


def test_this_machines_own_mountinfo_holds_its_root():
    with open("/proc/self/mountinfo") as fh:
        assert mount_of("/", parse_mountinfo(fh.read())).point == "/"


NFS = "nfs4 nas:/shared on /shared (local_lock=all)"
LOG_DIR = StorageFolder("LOG_DIR", "/shared/runs")


def test_nodes_that_agree_make_one_line_a_folder():
    views = [NodeView("n1", NFS, "nfs4, local_lock=all"), NodeView("n2", NFS, "", 0.012, "refused"),
             NodeView("n3", NFS, "", 0.4, "refused")]
    assert storage_lines(LOG_DIR, views) == [
        "check: LOG_DIR /shared/runs: nfs4 nas:/shared on /shared (local_lock=all) on all 3 nodes; a file written on n1 "
        "was seen on the others within 0.40 s; a lock held on n1 excludes the other nodes' ranks"]


def test_locks_that_exclude_nobody_are_said_with_what_covers_them():
    views = [NodeView("n1", NFS, "nfs4, local_lock=all"), NodeView("n2", NFS, "", 0.0, "granted"),
             NodeView("n3", NFS, "", 0.0, "granted")]
    assert storage_lines(LOG_DIR, views) == [
        "check: LOG_DIR /shared/runs: nfs4 nas:/shared on /shared (local_lock=all) on all 3 nodes; a file written on n1 "
        "was seen on the others within 0.00 s; a lock held on n1 does not exclude the other nodes' ranks",
        "check: locks on LOG_DIR (nfs4, local_lock=all) do not exclude across nodes (n2, n3 took one that n1 held): the "
        "run's claim and the data lock use a lease (a folder renamed into place), which does"]


def test_nodes_that_differ_make_one_line_a_node():
    ext4 = "ext4 /dev/sda1 on /"
    folder = StorageFolder("DATA_DIR", "/shared/data", probed_in="its parent")
    views = [NodeView("n1", NFS, "nfs4, local_lock=all"), NodeView("n2", ext4, "", 0.01, "granted"),
             NodeView("n3", NFS, "", None), NodeView("n4", NFS, "", 1.5, "failed (No locks available)")]
    assert storage_lines(folder, views, wait=30) == [
        f"check: DATA_DIR /shared/data (not there yet: probed in its parent) on n1: {NFS}; rank 0 wrote a file here and holds "
        "a lock on it",
        f"check: DATA_DIR on n2: {ext4}; the file written on n1 was seen "
        "after 0.01 s; a lock held on n1 does not exclude a rank here",
        f"check: DATA_DIR on n3: {NFS}; the file written on n1 was not "
        "seen after 30 s",
        f"check: DATA_DIR on n4: {NFS}; the file written on n1 was seen "
        "after 1.50 s; a lock here failed (No locks available)",
        "check: locks on DATA_DIR (nfs4, local_lock=all) do not exclude across nodes (n2 took one that n1 held): the run's "
        "claim and the data lock use a lease (a folder renamed into place), which does"]


def test_a_folder_rank_0_cannot_write_is_said_and_not_probed():
    folder = StorageFolder("DATA_DIR", "/shared/data", error="rank 0 cannot write there (Permission denied)")
    assert storage_lines(folder, [NodeView("n1", NFS, ""), NodeView("n2", NFS, "", None)]) == [
        f"check: DATA_DIR /shared/data: {NFS} on all 2 nodes; rank 0 cannot write there (Permission denied): not probed"]
    assert storage_lines(folder, [NodeView("n1", NFS, ""), NodeView("n2", "ext4 /dev/sda1 on /", "", None)]) == [
        f"check: DATA_DIR /shared/data on n1: {NFS}; rank 0 cannot write there (Permission denied): not probed",
        "check: DATA_DIR on n2: ext4 /dev/sda1 on /"]


def test_one_node_cannot_tell_whether_locks_exclude_across_nodes(tmp_path):
    lines = storage_check.check_storage_all_ranks({"LOG_DIR": tmp_path}, ["n1", "n1"], 0)
    assert len(lines) == 1 and lines[0].startswith(f"check: LOG_DIR {tmp_path}: ")
    assert lines[0].endswith("; whether its locks exclude across nodes cannot be told with one node")
    assert list(tmp_path.iterdir()) == []


def _probe_as_two_nodes(rank: int, init: str, folder: str, locks_exclude: bool, result: dict) -> None:
    from pathlib import Path
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if not locks_exclude and rank == 1:
        fcntl.lockf = lambda fd, operation, *rest: None  # (what a nolock mount does between two nodes)
    result[rank] = storage_check.check_storage_all_ranks({"LOG_DIR": Path(folder)}, ["n1", "n2"], rank, wait=10)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("locks_exclude", [True, False])
def test_two_ranks_on_two_nodes_probe_a_folder_and_leave_nothing_behind(tmp_path, locks_exclude):
    """Two real Gloo ranks posing as nodes n1 and n2 on this host: rank 1 sees rank 0's file
    and is refused its lock; with fcntl's locks made to lock nothing in rank 1, it takes it."""
    folder = tmp_path / "runs"
    folder.mkdir()
    result = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_probe_as_two_nodes, args=(rank, init, str(folder), locks_exclude, result))
             for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert result[1] == []
    lines = result[0]
    assert lines[0].startswith(f"check: LOG_DIR {folder}: ") and " on all 2 nodes; a file written on n1 was seen on the " \
        "others within " in lines[0], lines
    if locks_exclude:
        assert lines[0].endswith("; a lock held on n1 excludes the other nodes' ranks") and len(lines) == 1, lines
    else:
        assert lines[0].endswith("; a lock held on n1 does not exclude the other nodes' ranks"), lines
        assert lines[1].startswith("check: locks on LOG_DIR (") and "do not exclude across nodes (n2 took one that n1 " \
            "held)" in lines[1], lines
    assert list(folder.iterdir()) == []
