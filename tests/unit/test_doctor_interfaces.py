"""ddpkit/run/doctor.py's facts about the machine: the interface and address a rank would use,
and its CPU list, read from the kernel. `mnist_ddp.py --check` in real runs:
tests/runs/test_doctor.py.

    python -m pytest tests/unit/test_doctor_interfaces.py
"""


from ddpkit.run.doctor import cpu_list, interface_address, interface_of


def test_the_interface_facts_come_from_the_kernel():
    assert interface_address("lo") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    assert interface_address("no-such-if0") == ""
    assert cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
