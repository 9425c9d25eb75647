"""The SSH tunnel that tensorboard.sh prints, run for real: OpenSSH's sshd on a "login
node" (the local two-node Slurm's controller namespace) and on a compute node (a Slurm
node's namespace), and a third namespace as the user's computer, linked only to the
login node. tensorboard.sh runs on the compute node, once directly and once as an
`sbatch tensorboard.sh` job placed there; from the user's namespace the printed ssh
command runs verbatim (an `ssh -F` config adds only the key, known hosts and addresses),
and TensorBoard's HTTP API must list the runs through it, while nothing answers on the
compute node's own address.

Needs root, Slurm and openssh-server (`./local-slurm.sh install`).

    python -m pytest tests/cluster/own_clusters/test_tunnel.py
"""

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cluster import LOCAL_SLURM
from helpers.processes import ROOT, clean_env

SSH_PORT = 2222
USER_NS, LOGIN_LINK, USER_ADDR = "mt-user", "10.231.14.1", "10.231.14.2"


def in_ns(ns: str, *cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *cmd], **kwargs)


@pytest.fixture(scope="module")
def network(two_nodes, tmp_path_factory):
    """sshd on the login node (mt-ctl) and on compute node mtn1; the user's namespace,
    linked to the login node only; an ssh config for the user's side."""
    d = tmp_path_factory.mktemp("ssh")
    for key in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)
    subprocess.run(["ip", "netns", "add", USER_NS], check=True)
    subprocess.run(["ip", "-n", "mt-ctl", "link", "add", "user0", "type", "veth", "peer", "name", "eth0", "netns", USER_NS],
                   check=True)
    for ns, dev, addr in (("mt-ctl", "user0", LOGIN_LINK), (USER_NS, "eth0", USER_ADDR)):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
    subprocess.run(["ip", "-n", USER_NS, "link", "set", "lo", "up"], check=True)
    daemons = []
    for ns, addr in (("mt-ctl", LOGIN_LINK), ("mtn1", "10.231.9.11")):
        daemons.append(subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{ns}", "/usr/sbin/sshd", "-D", "-e", "-p", str(SSH_PORT), "-h", str(d / "host"),
             "-o", f"ListenAddress={addr}", "-o", f"AuthorizedKeysFile={d / 'authorized_keys'}", "-o", "StrictModes=no",
             "-o", "UsePAM=no", "-o", "PermitRootLogin=prohibit-password", "-o", f"PidFile={d / ns}.pid"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    login = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    (d / "config").write_text(
        f"Host *\n  Port {SSH_PORT}\n  IdentityFile {d / 'user'}\n  StrictHostKeyChecking no\n"
        f"  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  ExitOnForwardFailure yes\n"
        f"Host {login}\n  HostName {LOGIN_LINK}\nHost mtn1\n  HostName 10.231.9.11\n")
    logs = d / "logs"
    subprocess.run([sys.executable, str(ROOT / "mnist_ddp.py"), "--epochs", "1", "--max-steps", "3", "--log-dir", str(logs),
                    "--run-name", "seen-through-the-tunnel", "--data-dir", str(d / "data")],
                   env=clean_env(), check=True, capture_output=True, timeout=300)
    yield {"dir": d, "login": login, "logs": logs, "cluster": two_nodes}
    for daemon in daemons:
        daemon.terminate()
        daemon.wait(timeout=30)
    subprocess.run(["ip", "netns", "del", USER_NS], check=False)


def through_the_tunnel(network: dict, printed: str) -> list:
    """Run the printed ssh command in the user's namespace, -F config added after `ssh`;
    return TensorBoard's run list fetched through the tunnel."""
    argv = shlex.split(printed)
    assert argv[0] == "ssh" and "-J" in argv, printed
    port = int(re.search(r"-L (\d+):localhost:\1", printed).group(1))
    tunnel = subprocess.Popen(["nsenter", f"--net=/run/netns/{USER_NS}", "ssh", "-F", str(network["dir"] / "config"),
                               *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fetch = (f"import json, urllib.request; print(json.dumps(json.load(urllib.request.urlopen("
             f"'http://localhost:{port}/data/runs', timeout=5))))")
    try:
        deadline = time.monotonic() + 60
        while True:
            got = in_ns(USER_NS, sys.executable, "-c", fetch, capture_output=True, text=True)
            if got.returncode == 0:
                return json.loads(got.stdout)
            assert tunnel.poll() is None, f"ssh ended: {tunnel.communicate()[0]}"
            assert time.monotonic() < deadline, got.stderr[-1000:]
            time.sleep(0.5)
    finally:
        tunnel.terminate()
        tunnel.communicate(timeout=30)


def not_on_the_network(port: int) -> bool:
    """TensorBoard listens on the compute node's loopback only: its address refuses."""
    probe = (f"import socket, sys; s = socket.socket(); s.settimeout(3)\n"
             f"sys.exit(0 if s.connect_ex(('10.231.9.11', {port})) else 1)")
    return in_ns("mt-ctl", sys.executable, "-c", probe).returncode == 0


def test_tunnel_to_tensorboard_run_directly_on_a_compute_node(network):
    env = clean_env(LOGIN_HOST=network["login"], PATH=f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/bin")
    server = subprocess.Popen(
        ["nsenter", "--net=/run/netns/mtn1", "unshare", "--uts", "sh", "-c", 'hostname mtn1 && exec "$@"', "sh",
         str(ROOT / "tensorboard.sh"), "--logdir", str(network["logs"]), "--port", "random"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [server.stdout.readline() for _ in range(2)]
        printed = lines[1].strip()
        assert printed.startswith(f"ssh -N -J root@{network['login']} -L ") and printed.endswith(" root@mtn1"), lines
        assert "seen-through-the-tunnel" in through_the_tunnel(network, printed)
        assert not_on_the_network(int(re.search(r"-L (\d+):", printed).group(1)))
    finally:
        server.terminate()
        server.communicate(timeout=30)


def test_tunnel_to_tensorboard_as_a_batch_job(network, tmp_path):
    """`sbatch tensorboard.sh` from a directory outside the project, placed on mtn1: its output
    file starts with the tunnel command; scancel stops it."""
    cluster = network["cluster"]
    env = {**cluster.env, "PATH": "/usr/sbin:/usr/bin:/bin"}  # no tensorboard on the PATH: the project's .venv is found
    submitted = subprocess.run([str(LOCAL_SLURM), "exec", str(cluster.dir), "sbatch", "--parsable", "--nodelist=mtn1",
                                "--mem=1G", str(ROOT / "tensorboard.sh"), "--logdir", str(network["logs"])],
                               cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    job_id = submitted.stdout.strip()
    output = tmp_path / f"tensorboard-{job_id}.out"
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and "TensorBoard on 127.0.0.1:" in output.read_text()):
            assert time.monotonic() < deadline, output.read_text() if output.exists() else "no output file"
            time.sleep(0.2)
        text = output.read_text()
        printed = re.search(r"^  (ssh -N -J .*)$", text, re.M).group(1)
        assert printed.startswith(f"ssh -N -J root@{network['login']} -L ") and printed.endswith(" root@mtn1"), text
        assert text.splitlines()[0] == "On your own computer, open the tunnel:"
        assert "seen-through-the-tunnel" in through_the_tunnel(network, printed)
        assert not_on_the_network(int(re.search(r"-L (\d+):", printed).group(1)))
    finally:
        subprocess.run([str(LOCAL_SLURM), "exec", str(cluster.dir), "scancel", job_id], env=cluster.env, check=False)
    deadline = time.monotonic() + 60
    while subprocess.run([str(LOCAL_SLURM), "exec", str(cluster.dir), "squeue", "-h", "-j", job_id], env=cluster.env,
                         capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "scancel did not stop the TensorBoard job"
        time.sleep(0.5)
    assert subprocess.run(["pgrep", "-f", f"tensorboard --logdir {network['logs']}"], capture_output=True).returncode == 1
