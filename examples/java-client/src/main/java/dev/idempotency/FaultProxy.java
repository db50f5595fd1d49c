package dev.idempotency;

import java.io.BufferedInputStream;
import java.io.ByteArrayOutputStream;
import java.io.EOFException;
import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.atomic.AtomicReference;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * A fault-injecting HTTP/1.1 proxy on loopback, between the Java client and the catalog.
 *
 * <p>The next mutation (a POST or DELETE, metrics reports aside) after {@link #arm} gets the armed
 * fault; every other request is forwarded as it is. Each request goes to the catalog on a
 * connection of its own ({@code Connection: close}); the client's connection is kept alive.
 */
public final class FaultProxy implements AutoCloseable {
  /** What happens to the next mutation. */
  public enum Fault {
    /** Forwarded as it is. */
    NONE,
    /** (a) Forwarded; the catalog commits and answers; the answer is dropped with the connection. */
    DROP_ANSWER,
    /** (b) Answered 503 by the proxy; the catalog never sees it. */
    UNAVAILABLE,
    /**
     * (c) Forwarded with a header that makes the catalog take {@link #SLOW_MS} over it; the proxy
     * gives up after {@link #GATEWAY_TIMEOUT_MS} and answers 504 while the catalog still runs.
     */
    GATEWAY_TIMEOUT,
    /**
     * Forwarded with the same delay header and answered whenever the catalog answers: for a client
     * whose own socket timeout is shorter than {@link #SLOW_MS}.
     */
    SLOW,
    /**
     * (d) Forwarded; the catalog commits and answers; the metadata file the answer names is moved
     * away (as if deleted) before the answer is dropped with the connection, so the retry's replay
     * cannot read it. {@link #restoreMoved} puts it back.
     */
    DROP_ANSWER_AND_METADATA
  }

  /** How long the catalog takes over a request under {@link Fault#GATEWAY_TIMEOUT}. */
  public static final int SLOW_MS = 3000;

  /** How long the proxy waits for the catalog's answer before it answers 504. */
  public static final int GATEWAY_TIMEOUT_MS = 500;

  /** The header the catalog (started with ICEBERG_CATALOG_TEST_DELAYS=1) sleeps for. */
  public static final String DELAY_HEADER = "x-iceberg-catalog-test-delay-ms";

  /** One request as the proxy saw it. */
  public record Seen(
      String method, String path, String key, Fault fault, int catalogStatus, int clientStatus) {}

  private final ServerSocket server;
  private final int upstreamPort;
  private final String advertiseLifetime;
  private final AtomicReference<Fault> armed = new AtomicReference<>(Fault.NONE);
  private final List<Seen> seen = new CopyOnWriteArrayList<>();
  private final List<CompletableFuture<Void>> background = new CopyOnWriteArrayList<>();
  private final List<Socket> open = new CopyOnWriteArrayList<>();
  private final List<File> moved = new CopyOnWriteArrayList<>();
  private static final Pattern METADATA_LOCATION =
      Pattern.compile("\"metadata-location\"\\s*:\\s*\"([^\"]+)\"");

  /**
   * @param advertiseLifetime when not null, added to {@code GET /v1/config} answers as
   *     {@code idempotency-key-lifetime} (for a control run against a catalog without the layer
   *     that a client believes has it)
   */
  public FaultProxy(int upstreamPort, String advertiseLifetime) throws IOException {
    this.upstreamPort = upstreamPort;
    this.advertiseLifetime = advertiseLifetime;
    this.server = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
    Thread acceptor = new Thread(this::acceptLoop, "proxy-accept");
    acceptor.setDaemon(true);
    acceptor.start();
  }

  public int port() {
    return server.getLocalPort();
  }

  /** Arms a fault for the next mutation. */
  public void arm(Fault fault) {
    armed.set(fault);
  }

  /** Whether the armed fault was used (by a mutation since {@link #arm}). */
  public boolean fired() {
    return armed.get() == Fault.NONE;
  }

  public List<Seen> seen() {
    return seen;
  }

  /** Puts back the metadata files {@link Fault#DROP_ANSWER_AND_METADATA} moved away. */
  public void restoreMoved() {
    for (File file : moved) {
      if (!new File(file.getPath() + ".moved-away").renameTo(file)) {
        throw new IllegalStateException("could not restore " + file);
      }
    }
    moved.clear();
  }

  /** Waits for the requests that the proxy gave up on (504) to finish in the catalog. */
  public void awaitBackground() throws InterruptedException {
    for (CompletableFuture<Void> task : background) {
      try {
        task.get(30, TimeUnit.SECONDS);
      } catch (ExecutionException | TimeoutException e) {
        // noted as status -1 in seen()
      }
    }
    background.clear();
  }

  @Override
  public void close() throws IOException {
    server.close();
    for (Socket socket : open) {
      socket.close();
    }
  }

  private void acceptLoop() {
    while (!server.isClosed()) {
      try {
        Socket client = server.accept();
        open.add(client);
        Thread worker = new Thread(() -> serve(client), "proxy-conn");
        worker.setDaemon(true);
        worker.start();
      } catch (IOException e) {
        return;
      }
    }
  }

  private void serve(Socket client) {
    try (client) {
      InputStream in = new BufferedInputStream(client.getInputStream());
      OutputStream out = client.getOutputStream();
      while (true) {
        Message request = Message.read(in, true);
        if (request == null) {
          return;
        }
        if (!handle(request, out)) {
          return; // the connection is dropped
        }
      }
    } catch (IOException e) {
      // the client went away
    } finally {
      open.remove(client);
    }
  }

  /** Returns false when the client connection is to be dropped. */
  private boolean handle(Message request, OutputStream out) throws IOException {
    String[] line = request.startLine.split(" ");
    String method = line[0];
    String path = line[1];
    String key = request.header("idempotency-key");
    boolean mutation =
        (method.equals("POST") || method.equals("DELETE")) && !path.endsWith("/metrics");
    Fault fault = mutation ? armed.getAndSet(Fault.NONE) : Fault.NONE;

    switch (fault) {
      case UNAVAILABLE -> {
        byte[] body =
            "{\"error\":{\"message\":\"the proxy's upstream is unavailable\",\"type\":\"ServiceUnavailableException\",\"code\":503}}"
                .getBytes(StandardCharsets.UTF_8);
        Message answer = Message.response(503, "Service Unavailable", body);
        answer.write(out);
        seen.add(new Seen(method, path, key, fault, 0, 503));
        return true;
      }
      case DROP_ANSWER -> {
        Message answer = forward(request, null);
        seen.add(new Seen(method, path, key, fault, answer.status(), 0));
        return false;
      }
      case DROP_ANSWER_AND_METADATA -> {
        Message answer = forward(request, null);
        Matcher location =
            METADATA_LOCATION.matcher(new String(answer.body, StandardCharsets.UTF_8));
        if (location.find()) {
          File file = LocalFileIO.file(location.group(1));
          File away = new File(file.getPath() + ".moved-away");
          if (file.renameTo(away)) {
            moved.add(file);
          }
        }
        seen.add(new Seen(method, path, key, fault, answer.status(), 0));
        return false;
      }
      case GATEWAY_TIMEOUT -> {
        CompletableFuture<Message> pending = new CompletableFuture<>();
        Thread upstream =
            new Thread(
                () -> {
                  try {
                    pending.complete(forward(request, Integer.toString(SLOW_MS)));
                  } catch (Throwable e) {
                    pending.completeExceptionally(e);
                  }
                },
                "proxy-upstream");
        upstream.setDaemon(true);
        upstream.start();
        try {
          Message answer = pending.get(GATEWAY_TIMEOUT_MS, TimeUnit.MILLISECONDS);
          // The catalog was faster than the gateway timeout: no fault after all.
          answer.write(out);
          seen.add(new Seen(method, path, key, fault, answer.status(), answer.status()));
          return true;
        } catch (TimeoutException e) {
          background.add(
              pending.handle(
                  (answer, error) -> {
                    seen.add(
                        new Seen(method, path, key, fault, answer == null ? -1 : answer.status(), 504));
                    return null;
                  }));
          byte[] body =
              "{\"error\":{\"message\":\"the catalog did not answer in time\",\"type\":\"GatewayTimeoutException\",\"code\":504}}"
                  .getBytes(StandardCharsets.UTF_8);
          Message.response(504, "Gateway Timeout", body).write(out);
          return true;
        } catch (InterruptedException | ExecutionException e) {
          return false;
        }
      }
      default -> {
        Message answer = forward(request, fault == Fault.SLOW ? Integer.toString(SLOW_MS) : null);
        if (advertiseLifetime != null
            && method.equals("GET")
            && path.endsWith("/v1/config")
            && answer.status() == 200) {
          String config = new String(answer.body, StandardCharsets.UTF_8).trim();
          String amended =
              "{\"idempotency-key-lifetime\":\"" + advertiseLifetime + "\"," + config.substring(1);
          answer = answer.withBody(amended.getBytes(StandardCharsets.UTF_8));
        }
        answer.write(out);
        seen.add(new Seen(method, path, key, fault, answer.status(), answer.status()));
        return true;
      }
    }
  }

  private Message forward(Message request, String delayMs) throws IOException {
    try (Socket upstream = new Socket()) {
      upstream.connect(new InetSocketAddress(InetAddress.getLoopbackAddress(), upstreamPort));
      Message copy = request.withHeader("Connection", "close");
      if (delayMs != null) {
        copy = copy.withHeader(DELAY_HEADER, delayMs);
      }
      copy.write(upstream.getOutputStream());
      Message answer = Message.read(new BufferedInputStream(upstream.getInputStream()), false);
      if (answer == null) {
        throw new EOFException("the catalog closed the connection without an answer");
      }
      return answer.withoutHeader("Connection");
    }
  }

  /** An HTTP/1.1 message with its body read whole (Content-Length or chunked). */
  static final class Message {
    final String startLine;
    final List<String[]> headers;
    final byte[] body;

    Message(String startLine, List<String[]> headers, byte[] body) {
      this.startLine = startLine;
      this.headers = headers;
      this.body = body;
    }

    static Message response(int status, String reason, byte[] body) {
      List<String[]> headers = new ArrayList<>();
      headers.add(new String[] {"Content-Type", "application/json"});
      return new Message("HTTP/1.1 " + status + " " + reason, headers, body);
    }

    int status() {
      return Integer.parseInt(startLine.split(" ")[1]);
    }

    String header(String name) {
      for (String[] header : headers) {
        if (header[0].equalsIgnoreCase(name)) {
          return header[1];
        }
      }
      return null;
    }

    Message withoutHeader(String name) {
      List<String[]> kept = new ArrayList<>();
      for (String[] header : headers) {
        if (!header[0].equalsIgnoreCase(name)) {
          kept.add(header);
        }
      }
      return new Message(startLine, kept, body);
    }

    Message withHeader(String name, String value) {
      Message without = withoutHeader(name);
      without.headers.add(new String[] {name, value});
      return without;
    }

    Message withBody(byte[] newBody) {
      return new Message(startLine, headers, newBody);
    }

    void write(OutputStream out) throws IOException {
      StringBuilder head = new StringBuilder(startLine).append("\r\n");
      for (String[] header : headers) {
        String name = header[0].toLowerCase(Locale.ROOT);
        if (!name.equals("content-length") && !name.equals("transfer-encoding")) {
          head.append(header[0]).append(": ").append(header[1]).append("\r\n");
        }
      }
      head.append("Content-Length: ").append(body.length).append("\r\n\r\n");
      out.write(head.toString().getBytes(StandardCharsets.ISO_8859_1));
      out.write(body);
      out.flush();
    }

    /** Reads one message, or returns null at the end of the stream before it. */
    static Message read(InputStream in, boolean isRequest) throws IOException {
      String startLine = readLine(in);
      if (startLine == null) {
        return null;
      }
      List<String[]> headers = new ArrayList<>();
      String line;
      while ((line = readLine(in)) != null && !line.isEmpty()) {
        int colon = line.indexOf(':');
        headers.add(new String[] {line.substring(0, colon).trim(), line.substring(colon + 1).trim()});
      }
      Message head = new Message(startLine, headers, new byte[0]);
      String length = head.header("content-length");
      String encoding = head.header("transfer-encoding");
      byte[] body;
      if (encoding != null && encoding.toLowerCase(Locale.ROOT).contains("chunked")) {
        ByteArrayOutputStream collected = new ByteArrayOutputStream();
        while (true) {
          String size = readLine(in);
          if (size == null) {
            throw new EOFException("chunked body cut short");
          }
          int n = Integer.parseInt(size.split(";")[0].trim(), 16);
          if (n == 0) {
            while ((line = readLine(in)) != null && !line.isEmpty()) {
              // trailers are dropped
            }
            break;
          }
          collected.write(in.readNBytes(n));
          readLine(in);
        }
        body = collected.toByteArray();
      } else if (length != null) {
        body = in.readNBytes(Integer.parseInt(length));
      } else if (isRequest) {
        body = new byte[0];
      } else {
        body = in.readAllBytes();
      }
      return new Message(startLine, headers, body);
    }

    private static String readLine(InputStream in) throws IOException {
      ByteArrayOutputStream line = new ByteArrayOutputStream();
      int b;
      while ((b = in.read()) != -1) {
        if (b == '\n') {
          byte[] bytes = line.toByteArray();
          int end = bytes.length > 0 && bytes[bytes.length - 1] == '\r' ? bytes.length - 1 : bytes.length;
          return new String(bytes, 0, end, StandardCharsets.ISO_8859_1);
        }
        line.write(b);
      }
      return line.size() == 0 ? null : line.toString(StandardCharsets.ISO_8859_1);
    }
  }
}
