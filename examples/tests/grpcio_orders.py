"""Drives grpc-orders with Python's grpcio, as a client nobody on this project wrote.

Usage: grpcio_orders.py HOST:PORT (with the stubs grpc_tools.protoc generated from
examples/proto/orders.proto on PYTHONPATH). Every check asserts; the last line printed is
"grpcio: all checks passed".
"""

import sys
import threading
import time

import grpc

import orders_pb2
import orders_pb2_grpc

TIMEOUT = 20


def call(stub, item, key=None, keys=None):
    """CreateOrder: returns (order or None, status code, details, replayed)."""
    metadata = [("idempotency-key", k) for k in (keys or ([key] if key else []))]
    try:
        order, rpc = stub.CreateOrder.with_call(
            orders_pb2.CreateOrderRequest(item=item), metadata=metadata, timeout=TIMEOUT
        )
        return order, rpc.code(), rpc.details(), replayed(rpc.initial_metadata())

    except grpc.RpcError as error:
        # A trailers-only answer (every status but OK here) has all its metadata in the
        # trailing metadata, as grpcio reports it.
        return None, error.code(), error.details(), replayed(error.trailing_metadata())


def replayed(metadata):
    return any(k == "idempotent-replayed" and v == "true" for k, v in metadata or ())


def listed(stub, key=None):
    metadata = [("idempotency-key", key)] if key else []
    return [(o.id, o.item) for o in stub.ListOrders(orders_pb2.ListOrdersRequest(), metadata=metadata, timeout=TIMEOUT)]


def main(address):
    with grpc.insecure_channel(address) as channel:
        stub = orders_pb2_grpc.OrdersStub(channel)

        # A keyed call runs once; its retry gets the same order, status OK, marked replayed.
        first, code, _, was_replayed = call(stub, "book", "py-1")
        assert code == grpc.StatusCode.OK and first.id == 1 and not was_replayed, (first, code)
        again, code, _, was_replayed = call(stub, "book", "py-1")
        assert code == grpc.StatusCode.OK and again == first and was_replayed, (again, code, was_replayed)

        # Eight concurrent calls with one key on a slow item: one order, one execution.
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(call(stub, "slow", "py-2"))) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len({a[0].id for a in answers}) == 1, answers
        assert sum(1 for a in answers if not a[3]) == 1, answers

        # A duplicate that arrives while the slow call runs waits and gets its order.
        result = {}
        slow = threading.Thread(target=lambda: result.update(first=call(stub, "slow", "py-3")))
        slow.start()
        time.sleep(0.5)
        duplicate = call(stub, "slow", "py-3")
        slow.join()
        assert duplicate[0] == result["first"][0] and duplicate[3], (duplicate, result)

        # UNAVAILABLE (trailers-only) releases the key: every retry runs again.
        for _ in range(2):
            order, code, _, was_replayed = call(stub, "unavailable", "py-4")
            assert order is None and code == grpc.StatusCode.UNAVAILABLE and not was_replayed, (code, was_replayed)

        # INVALID_ARGUMENT is stored: the retry gets the same code and message.
        _, code, details, _ = call(stub, "invalid", "py-5")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "item is invalid", (code, details)
        _, code, details, was_replayed = call(stub, "invalid", "py-5")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "item is invalid" and was_replayed, (code, details)

        # A key reused with another message: FAILED_PRECONDITION, nothing runs.
        _, code, details, _ = call(stub, "lamp", "py-1")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "send a new key" in details, (code, details)

        # Bad keys: INVALID_ARGUMENT, nothing runs.
        _, code, details, _ = call(stub, "pen", "k" * 300)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "send at most 255" in details, (code, details)
        _, code, details, _ = call(stub, "pen", keys=["a", "b"])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than one" in details, (code, details)

        # Streaming passes through, key or no key; it sees every order, in id order.
        orders = listed(stub, "py-list")
        assert orders == [(1, "book"), (2, "slow"), (3, "slow")], orders
        call(stub, "pen")
        assert len(listed(stub, "py-list")) == 4

        # AIP-155: PlaceOrder's key is the message's request_id, with no metadata.
        placed, rpc = stub.PlaceOrder.with_call(
            orders_pb2.PlaceOrderRequest(item="mug", request_id="py-aip-1"), timeout=TIMEOUT
        )
        assert placed.item == "mug" and not replayed(rpc.initial_metadata()), placed
        again, rpc = stub.PlaceOrder.with_call(
            orders_pb2.PlaceOrderRequest(item="mug", request_id="py-aip-1"), timeout=TIMEOUT
        )
        assert again == placed and replayed(rpc.initial_metadata()), (again, placed)
        try:
            stub.PlaceOrder(orders_pb2.PlaceOrderRequest(item="cup", request_id="py-aip-1"), timeout=TIMEOUT)
            raise AssertionError("another message with the same request_id ran")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
        assert len(listed(stub)) == 5

    print("grpcio: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
