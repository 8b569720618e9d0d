"""Connection lifetimes behind a connection-level (L4) balancer, such as a Kubernetes Service.

A long-lived client channel talks to a TCP proxy that picks a backend per new connection, round
robin, as kube-proxy does. Server A runs alone at first; then server B starts and joins the proxy.
With --max-connection-age the servers send GOAWAY to aged connections, the channel reconnects, and
its calls reach B. Without it (the old behaviour) the one connection to A would carry every call
forever, however many replicas the autoscaler added.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
from _server import HOST, wait_until

from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

AGE = 1  # seconds: --max-connection-age of both servers (with grace), short so the test is quick
FLAGS = dict(threads=1, max_batch=2, max_connection_age=AGE, max_connection_age_grace=5)


class RoundRobinTcpProxy:
    """Accepts TCP connections and pipes each to the next backend in turn (backends may be added)."""

    def __init__(self):
        self.backends: list[int] = []
        self.connections: list[int] = []  # the backend port of each accepted connection
        self._sock = socket.create_server((HOST, 0))
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            port = self.backends[len(self.connections) % len(self.backends)]
            self.connections.append(port)
            try:
                upstream = socket.create_connection((HOST, port))
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._closed = True
        self._sock.close()


def served(server) -> float:
    return server.metrics().total("lmserve_requests_total")


def test_a_long_lived_channel_reaches_a_replica_started_later(start_server, trained_model_dir):
    a = start_server(trained_model_dir, **FLAGS)
    proxy = RoundRobinTcpProxy()
    proxy.backends.append(a.port)
    call = pb.GenerateRequest(prompt="The baker", params=pb.SamplingParams(max_new_tokens=1))
    failures = []
    try:
        with grpc.insecure_channel(f"{HOST}:{proxy.port}") as channel:  # one channel for the whole test
            stub = pb_grpc.TextGenerationStub(channel)

            def some_calls(n=5):
                for _ in range(n):
                    try:
                        stub.Generate(call, timeout=30, wait_for_ready=True)
                    except grpc.RpcError as exc:
                        failures.append(exc.code())
                    time.sleep(0.05)

            some_calls()
            assert served(a) >= 5
            b = start_server(trained_model_dir, **FLAGS)
            proxy.backends.append(b.port)  # B joins the balancer; the channel's connection still goes to A

            def reached_b():
                some_calls()
                return served(b) > 0
            wait_until(reached_b, timeout=60, interval=0.1, what="calls of the long-lived channel to reach B")
    finally:
        proxy.close()
    assert b.port in proxy.connections and proxy.connections[0] == a.port
    print(f"\nconnections made by one channel: {len(proxy.connections)}; failed calls: {failures}")
    # connections were recycled without failing calls: GOAWAY lets calls in flight finish
    assert failures == [], failures
