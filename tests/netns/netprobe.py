#!/usr/bin/env python3
"""Measures a link between two hosts of the netns cluster: bulk TCP throughput (as the
receiver counts it) and TCP round-trip time. Standard library only.

  netprobe.py serve --port P               # in the receiving host's namespace
  netprobe.py bulk --to ADDR:P --seconds S # prints {"bytes":..,"seconds":..,"bits_per_s":..}
  netprobe.py rtt --to ADDR:P --count N    # prints {"median_ms":..,"min_ms":..,"p90_ms":..}
"""
import argparse
import json
import socket
import socketserver
import statistics
import struct
import sys
import time

CHUNK = 1 << 16


class Handler(socketserver.BaseRequestHandler):
    def handle(self):
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = sock.recv(1)
        if mode == b"B":
            # Bulk: count bytes from the first to the last one received, answer with both.
            total, first, last = 0, None, None
            while True:
                data = sock.recv(CHUNK)
                if not data:
                    break
                now = time.monotonic()
                if first is None:
                    first = now
                total += len(data)
                last = now
            elapsed = (last - first) if first is not None else 0.0
            sock.sendall(struct.pack("!Qd", total, elapsed))
        elif mode == b"P":
            # Ping-pong: echo every byte until the peer closes.
            while True:
                data = sock.recv(1)
                if not data:
                    break
                sock.sendall(data)


class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


def addr(text):
    host, port = text.rsplit(":", 1)
    return host, int(port)


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise ConnectionError("peer closed early")
        buf += data
    return buf


def bulk(to, seconds):
    payload = b"\0" * CHUNK
    with socket.create_connection(to, timeout=30) as sock:
        sock.sendall(b"B")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        total, elapsed = struct.unpack("!Qd", recv_exact(sock, 16))
    rate = total * 8 / elapsed if elapsed > 0 else 0.0
    return {"bytes": total, "seconds": elapsed, "bits_per_s": rate}


def rtt(to, count):
    times = []
    with socket.create_connection(to, timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"P")
        for _ in range(count):
            start = time.perf_counter()
            sock.sendall(b"x")
            recv_exact(sock, 1)
            times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "min_ms": times[0],
        "p90_ms": times[int(0.9 * (len(times) - 1))],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    b = sub.add_parser("bulk")
    b.add_argument("--to", type=addr, required=True)
    b.add_argument("--seconds", type=float, default=3.0)
    r = sub.add_parser("rtt")
    r.add_argument("--to", type=addr, required=True)
    r.add_argument("--count", type=int, default=50)
    a = p.parse_args()
    if a.cmd == "serve":
        with Server(("0.0.0.0", a.port), Handler) as server:
            server.serve_forever()
    elif a.cmd == "bulk":
        print(json.dumps(bulk(a.to, a.seconds)))
    else:
        print(json.dumps(rtt(a.to, a.count)))


if __name__ == "__main__":
    sys.exit(main())
