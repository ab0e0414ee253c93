"""This host's addresses: `--advertise-address`, the address its workers
publish in `TF_CONFIG` (so a job can use the fast network rather than
whichever interface reached the rendezvous)."""

import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def advertise_address(value, name="advertise_address"):
    """The address of this host that `value` names: an IP address of one
    of its interfaces, or an interface name (its IPv4 address).

    An address is this host's if a socket can bind it (the kernel's own
    test, the one the workers' gRPC servers face).

    Args:
        value: An IP address such as `"10.0.0.5"`, or an interface name
            such as `"ib0"`.
        name: The argument to name in errors. Defaults to
            `"advertise_address"`.

    Returns:
        The IP address, a string.

    Raises:
        ValueError: If `value` is neither an address of this host nor an
            interface with an IPv4 address; the message lists the host's
            interfaces and their addresses.

    Example:

    >>> advertise_address("127.0.0.1"), advertise_address("lo")
    ('127.0.0.1', '127.0.0.1')
    """
    text = value.strip() if isinstance(value, str) else ""
    try:
        address = str(ipaddress.ip_address(text))
    except ValueError:
        address = interface_addresses().get(text) if text else None
        if address is None:
            _fail(
                name,
                value,
                "is not an IP address, nor an interface with an IPv4 address",
            )
    if ipaddress.ip_address(address).is_unspecified:
        _fail(name, value, "is no address a worker can be reached at")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            _fail(name, value, "is not an address of this host")
    return address


def interface_addresses():
    """`{interface name: IPv4 address}` for this host's interfaces that
    have one (Linux; elsewhere empty)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return {}
    found = {}
    for _, interface in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            request = struct.pack("256s", interface.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address (or not Linux)
        found[interface] = socket.inet_ntoa(reply[20:24])
    return found


def _fail(name, value, why):
    listed = ", ".join(f"{n} {a}" for n, a in interface_addresses().items())
    raise ValueError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}, "
        f"which {why}. Expected an address of one of this host's "
        f"interfaces or an interface name ({listed or 'none found'})."
    )
