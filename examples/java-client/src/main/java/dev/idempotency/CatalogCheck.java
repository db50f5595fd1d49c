package dev.idempotency;

import dev.idempotency.FaultProxy.Fault;
import java.io.File;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.UUID;
import java.util.stream.Collectors;
import org.apache.iceberg.BaseTable;
import org.apache.iceberg.DataFile;
import org.apache.iceberg.DataFiles;
import org.apache.iceberg.FileFormat;
import org.apache.iceberg.ManifestFile;
import org.apache.iceberg.PartitionSpec;
import org.apache.iceberg.Schema;
import org.apache.iceberg.Snapshot;
import org.apache.iceberg.Table;
import org.apache.iceberg.TableMetadata;
import org.apache.iceberg.catalog.Namespace;
import org.apache.iceberg.catalog.TableCommit;
import org.apache.iceberg.catalog.TableIdentifier;
import org.apache.iceberg.rest.RESTCatalog;
import org.apache.iceberg.types.Types;
import org.apache.iceberg.view.BaseView;
import org.apache.iceberg.view.View;

/**
 * Drives the Iceberg Java {@link RESTCatalog} (iceberg-core 1.12.0) through a {@link FaultProxy}
 * against a catalog, and checks the effect of every mutation through a second client that talks
 * to the catalog directly.
 *
 * <pre>
 * java ... dev.idempotency.CatalogCheck --catalog http://127.0.0.1:8181 --run RUN --mode layer [--grow N]
 * </pre>
 *
 * <p>{@code --grow N} commits N snapshots to the first table (directly, before the operations
 * on it) in the scenarios that lose an answer after the commit ({@code DROP_ANSWER}, {@code
 * GATEWAY_TIMEOUT}), so that the operations after it answer, and are replayed, with a large
 * table's metadata.
 *
 * <p>Modes: {@code layer} (the catalog has the layer; any error, wrong effect or deleted file
 * fails the run), {@code control} (the catalog runs with --no-idempotency: the failures are
 * counted, and an operation that failed is retried once by the program, as an application would),
 * {@code control-advertised} (the same, with the proxy advertising a key lifetime the catalog
 * does not honour, so the client sends keys and retries on its own), {@code gone} (one commit
 * whose answer is lost and whose metadata file is gone before the retry: see {@link #gone}).
 *
 * <p>Prints one {@code OP} line per operation and scenario, and a {@code SUMMARY} line.
 */
public final class CatalogCheck {
  private static final Schema SCHEMA =
      new Schema(
          Types.NestedField.required(1, "id", Types.LongType.get()),
          Types.NestedField.optional(2, "data", Types.StringType.get()));

  private final RESTCatalog client;
  private final RESTCatalog observer;
  private final FaultProxy proxy;
  private final boolean control;
  private final Map<String, Integer> errors = new TreeMap<>();
  private final Map<String, Integer> appRetryErrors = new TreeMap<>();
  private final List<String> wrong = new ArrayList<>();
  private int operations;
  private Namespace currentNamespace;
  private Map<TableIdentifier, int[]> baseline = Map.of();
  private int notFired;
  /** Snapshots committed to the first table before the operations on it (--grow). */
  private final int grow;

  private CatalogCheck(
      RESTCatalog client, RESTCatalog observer, FaultProxy proxy, boolean control, int grow) {
    this.client = client;
    this.observer = observer;
    this.proxy = proxy;
    this.control = control;
    this.grow = grow;
  }

  /** An operation, run by the client through the proxy. */
  @FunctionalInterface
  interface Action {
    void run() throws Exception;
  }

  /** The check of an operation's effect, through the observer; returns what is wrong, or null. */
  @FunctionalInterface
  interface Effect {
    String check() throws Exception;
  }

  public static void main(String[] args) throws Exception {
    Map<String, String> options = new HashMap<>();
    for (int i = 0; i + 1 < args.length; i += 2) {
      options.put(args[i].replaceFirst("^--", ""), args[i + 1]);
    }
    String catalogUri = options.get("catalog");
    String run = options.getOrDefault("run", "r" + System.currentTimeMillis());
    String mode = options.getOrDefault("mode", "layer");
    List<Fault> scenarios =
        List.of(options.getOrDefault("scenarios", "NONE,DROP_ANSWER,UNAVAILABLE,GATEWAY_TIMEOUT")
                .split(","))
            .stream()
            .map(Fault::valueOf)
            .toList();
    boolean control = !mode.equals("layer");
    int upstreamPort = Integer.parseInt(catalogUri.replaceAll(".*:(\\d+)/?$", "$1"));

    try (FaultProxy proxy =
            new FaultProxy(upstreamPort, mode.equals("control-advertised") ? "PT30M" : null);
        RESTCatalog client =
            catalog(
                "client",
                "http://127.0.0.1:" + proxy.port(),
                options.get("socket-timeout-ms"));
        RESTCatalog observer = catalog("observer", catalogUri, null)) {
      int grow = Integer.parseInt(options.getOrDefault("grow", "0"));
      CatalogCheck check = new CatalogCheck(client, observer, proxy, control, grow);
      if (mode.equals("gone")) {
        System.exit(check.gone(run));
      }
      long started = System.nanoTime();
      for (Fault scenario : scenarios) {
        check.scenario(run + "_" + scenario.name().toLowerCase(), scenario);
      }
      proxy.awaitBackground();
      System.out.printf(
          "TIME mode=%s seconds=%.1f%n", mode, (System.nanoTime() - started) / 1e9);
      int status = check.summary(mode);
      System.exit(control ? 0 : status);
    }
  }

  static RESTCatalog catalog(String name, String uri, String socketTimeoutMs) {
    Map<String, String> properties = new LinkedHashMap<>();
    properties.put("uri", uri);
    if (socketTimeoutMs != null) {
      properties.put("rest.client.socket-timeout-ms", socketTimeoutMs);
    }
    properties.put("io-impl", LocalFileIO.class.getName());
    // No metrics reports after commits: only the catalog's own operations go through the proxy.
    properties.put("rest-metrics-reporting-enabled", "false");
    RESTCatalog catalog = new RESTCatalog();
    catalog.initialize(name, properties);
    return catalog;
  }

  /**
   * A commit whose answer is lost and whose metadata file is gone (moved away) before the
   * client's retry, so the catalog cannot replay it: the client must report the commit's state
   * as unknown (neither a success nor a failure), keep its files, and the commit must have landed
   * once. Prints a {@code SUMMARY} line; 0 if all of that holds.
   */
  private int gone(String ns) throws Exception {
    Namespace namespace = Namespace.of(ns);
    TableIdentifier t = TableIdentifier.of(namespace, "events");
    client.createNamespace(namespace);
    client.createTable(t, SCHEMA);
    grow(observer, t, grow);
    int filesBefore = ((BaseTable) observer.loadTable(t)).operations().current().previousFiles().size();
    Table table = client.loadTable(t);
    int seenBefore = proxy.seen().size();
    proxy.arm(Fault.DROP_ANSWER_AND_METADATA);
    String error = attempt(() -> table.updateProperties().set("gone", "1").commit());
    proxy.restoreMoved();
    Table after = observer.loadTable(t);
    int commits =
        ((BaseTable) after).operations().current().previousFiles().size() - filesBefore;
    String statuses =
        proxy.seen().subList(seenBefore, proxy.seen().size()).stream()
            .filter(seen -> seen.method().equals("POST"))
            .map(seen -> seen.catalogStatus() + "/" + seen.clientStatus())
            .collect(Collectors.joining(","));
    System.out.printf(
        "SUMMARY mode=gone error=%s property=%s commits=%d deleted_files=%d catalog/client=%s%n",
        error == null ? "none" : error,
        after.properties().get("gone"),
        commits,
        LocalFileIO.DELETED.size(),
        statuses);
    boolean asDocumented =
        "CommitStateUnknownException".equals(error)
            && "1".equals(after.properties().get("gone"))
            && commits == 1
            && LocalFileIO.DELETED.isEmpty();
    return asDocumented ? 0 : 1;
  }

  private void scenario(String ns, Fault fault) throws Exception {
    Namespace namespace = Namespace.of(ns);
    currentNamespace = namespace;
    TableIdentifier t = TableIdentifier.of(namespace, "events");
    TableIdentifier t2 = TableIdentifier.of(namespace, "audit");
    TableIdentifier t2Renamed = TableIdentifier.of(namespace, "audit_renamed");
    TableIdentifier v = TableIdentifier.of(namespace, "recent");
    TableIdentifier vRegistered = TableIdentifier.of(namespace, "recent_copy");

    op(fault, "createNamespace", () -> client.createNamespace(namespace), () ->
        observer.namespaceExists(namespace) ? null : "namespace missing");

    // Every metadata file stays in the log, so that its entries count the commits of a
    // grown table too.
    op(fault, "createTable", () -> client.createTable(t, SCHEMA, PartitionSpec.unpartitioned(),
            Map.of("write.metadata.previous-versions-max", "10000")),
        () -> tableCheck(t, 1, 0, 1));

    op(fault, "createTable(second)", () -> client.createTable(t2, SCHEMA), () ->
        tableCheck(t2, 1, 0, 1));

    // Where an answer is lost after the commit, the operations below then answer (and are
    // replayed) with a few hundred snapshots' metadata.
    if (fault == Fault.DROP_ANSWER || fault == Fault.GATEWAY_TIMEOUT) {
      grow(observer, t, grow);
    }

    op(fault, "appendFiles", () -> {
          Table table = client.loadTable(t);
          table.newAppend().appendFile(dataFile(table, "part-0")).appendFile(dataFile(table, "part-1")).commit();
        }, () -> {
          String wrongTable = tableCheck(t, 1, 1, 0);
          if (wrongTable != null) {
            return wrongTable;
          }
          Snapshot snapshot = observer.loadTable(t).currentSnapshot();
          String added = snapshot.summary().get("total-data-files");
          return "2".equals(added) ? null : "total-data-files " + added + ", not 2";
        });

    op(fault, "updateSchema", () -> client.loadTable(t).updateSchema()
            .addColumn("note", Types.StringType.get()).commit(), () -> {
          Table table = observer.loadTable(t);
          if (table.schema().findField("note") == null) {
            return "column note missing";
          }
          return tableCheck(t, 1, 0, 1);
        });

    op(fault, "commitTransaction", () -> {
          List<TableCommit> commits = new ArrayList<>();
          for (TableIdentifier id : List.of(t, t2)) {
            TableMetadata base = ((BaseTable) client.loadTable(id)).operations().current();
            TableMetadata updated =
                TableMetadata.buildFrom(base).setProperties(Map.of("owner", "txn-" + ns)).build();
            commits.add(TableCommit.create(id, base, updated));
          }
          client.commitTransaction(commits);
        }, () -> {
          for (TableIdentifier id : List.of(t, t2)) {
            if (!("txn-" + ns).equals(observer.loadTable(id).properties().get("owner"))) {
              return id + ": property owner not set";
            }
          }
          String wrongT = tableCheck(t, 1, 0, 0);
          return wrongT != null ? wrongT : tableCheck(t2, 1, 0, 0);
        });

    op(fault, "renameTable", () -> client.renameTable(t2, t2Renamed), () -> {
          if (observer.tableExists(t2)) {
            return "old name still there";
          }
          return observer.tableExists(t2Renamed) ? null : "new name missing";
        });

    op(fault, "createView", () -> client.buildView(v).withSchema(SCHEMA)
            .withDefaultNamespace(namespace).withQuery("spark", "SELECT id, data FROM events")
            .create(), () -> viewCheck(v, 1, "SELECT id, data FROM events"));

    op(fault, "registerView", () -> client.registerView(vRegistered,
            ((BaseView) client.loadView(v)).operations().current().metadataFileLocation()),
        () -> viewCheck(vRegistered, 1, "SELECT id, data FROM events"));

    op(fault, "replaceView", () -> client.buildView(v).withSchema(SCHEMA)
            .withDefaultNamespace(namespace).withQuery("spark", "SELECT id FROM events")
            .replace(), () -> viewCheck(v, 2, "SELECT id FROM events"));

    op(fault, "dropView", () -> dropped(client.dropView(vRegistered)), () ->
        observer.viewExists(vRegistered) ? "view still there" : null);

    op(fault, "dropTable", () -> dropped(client.dropTable(t, false)), () -> {
          if (observer.tableExists(t)) {
            return "table still there";
          }
          return observer.listTables(namespace).equals(List.of(t2Renamed))
              ? null
              : "tables left: " + observer.listTables(namespace);
        });
  }

  /**
   * Runs one operation with {@code fault} armed. Under the layer any error is wrong; in a control
   * run an error is counted and the operation is run once more, as an application would.
   */
  private void op(Fault fault, String name, Action action, Effect effect) throws Exception {
    operations++;
    int seenBefore = proxy.seen().size();
    int deletedBefore = LocalFileIO.DELETED.size();
    baseline = counts(currentNamespace);
    proxy.arm(fault);
    String error = attempt(action);
    boolean fired = proxy.fired();
    proxy.arm(Fault.NONE);
    if (!fired) {
      notFired++;
      wrong.add(fault + " " + name + ": the fault was not used");
    }
    if (fault == Fault.GATEWAY_TIMEOUT) {
      // The request the proxy gave up on finishes in the catalog before the effect is checked.
      proxy.awaitBackground();
    }
    if (fault == Fault.SLOW && error != null) {
      // The client gave up on its own; the catalog still finishes the request.
      Thread.sleep(FaultProxy.SLOW_MS);
    }
    String appRetry = "none";
    if (error != null) {
      errors.merge(error, 1, Integer::sum);
      if (control) {
        String again = attempt(action);
        appRetry = again == null ? "ok" : again;
        if (again != null) {
          appRetryErrors.merge(again, 1, Integer::sum);
        }
      }
    }
    String wrongEffect = effect.check();
    if (wrongEffect == null) {
      wrongEffect = filesCheck(currentNamespace, deletedBefore);
    }
    if (wrongEffect != null) {
      wrong.add(fault + " " + name + ": " + wrongEffect);
    }
    List<FaultProxy.Seen> seen = proxy.seen().subList(seenBefore, proxy.seen().size());
    List<FaultProxy.Seen> mutations =
        seen.stream().filter(s -> !s.method().equals("GET") && !s.method().equals("HEAD")).toList();
    Set<String> keys =
        mutations.stream().map(FaultProxy.Seen::key).filter(k -> k != null).collect(Collectors.toSet());
    String statuses =
        mutations.stream()
            .map(s -> s.catalogStatus() + "/" + s.clientStatus())
            .collect(Collectors.joining(","));
    System.out.printf(
        "OP fault=%s op=%s error=%s app_retry=%s effect=%s deleted=%d mutations=%d keys=%s"
            + " catalog/client=%s%n",
        fault,
        name,
        error == null ? "none" : error,
        appRetry,
        wrongEffect == null ? "ok" : "WRONG(" + wrongEffect + ")",
        LocalFileIO.DELETED.size() - deletedBefore,
        mutations.size(),
        keys.stream().map(CatalogCheck::keyVersion).sorted().collect(Collectors.joining("+")),
        statuses);
  }

  /**
   * Commits {@code snapshots} empty appends to a table, directly (not through the proxy): each
   * adds a snapshot, a history entry and a metadata file, so that every answer about the table
   * carries them all.
   */
  static void grow(RESTCatalog catalog, TableIdentifier id, int snapshots) {
    Table table = catalog.loadTable(id);
    for (int i = 0; i < snapshots; i++) {
      table.newAppend().commit();
    }
  }

  private static String keyVersion(String key) {
    UUID uuid = UUID.fromString(key);
    return "uuidv" + uuid.version();
  }

  private static String attempt(Action action) {
    try {
      action.run();
      return null;
    } catch (Exception e) {
      System.out.println("  error: " + e);
      return e.getClass().getSimpleName();
    }
  }

  private static DataFile dataFile(Table table, String name) {
    return DataFiles.builder(table.spec())
        .withPath(table.location() + "/data/" + name + "-" + UUID.randomUUID() + ".parquet")
        .withFileSizeInBytes(1024)
        .withRecordCount(10)
        .withFormat(FileFormat.PARQUET)
        .build();
  }

  /** A drop that the client was told found nothing is an error (a lost answer's retry). */
  private static void dropped(boolean found) {
    if (!found) {
      throw new IllegalStateException("the drop answered that there was nothing to drop");
    }
  }

  /** Metadata files, snapshots and schemas of each table in the namespace. */
  private Map<TableIdentifier, int[]> counts(Namespace namespace) {
    Map<TableIdentifier, int[]> counts = new HashMap<>();
    if (namespace != null && observer.namespaceExists(namespace)) {
      for (TableIdentifier id : observer.listTables(namespace)) {
        Table table = observer.loadTable(id);
        TableMetadata metadata = ((BaseTable) table).operations().current();
        int snapshots = 0;
        for (Snapshot ignored : table.snapshots()) {
          snapshots++;
        }
        if (table.history().size() != snapshots) {
          wrong.add(id + ": " + table.history().size() + " history entries, " + snapshots + " snapshots");
        }
        counts.put(id, new int[] {metadata.previousFiles().size() + 1, snapshots, table.schemas().size()});
      }
    }
    return counts;
  }

  /**
   * The table is listed once, and the operation added exactly this many commits (metadata files;
   * a created table has one), snapshots (history entries) and schemas.
   */
  private String tableCheck(TableIdentifier id, int commits, int snapshots, int schemas) {
    long named = observer.listTables(id.namespace()).stream().filter(id::equals).count();
    if (named != 1) {
      return id.name() + " listed " + named + " times";
    }
    int[] before = baseline.getOrDefault(id, new int[] {0, 0, 0});
    int[] after = counts(id.namespace()).get(id);
    String[] what = {"commits", "snapshots", "schemas"};
    int[] expected = {commits, snapshots, schemas};
    for (int i = 0; i < 3; i++) {
      if (after[i] - before[i] != expected[i]) {
        return id.name() + ": " + (after[i] - before[i]) + " new " + what[i] + ", not " + expected[i];
      }
    }
    return null;
  }

  private String viewCheck(TableIdentifier id, int versions, String sql) {
    if (!observer.viewExists(id)) {
      return "view missing";
    }
    View view = observer.loadView(id);
    int count = 0;
    for (var ignored : view.versions()) {
      count++;
    }
    if (count != versions) {
      return count + " view versions, not " + versions;
    }
    String current = view.sqlFor("spark").sql();
    return current.equals(sql) ? null : "view query is " + current;
  }

  /**
   * Every manifest list and manifest of every table in the namespace exists on disk (files that the
   * client deleted are counted apart: a deleted file that no snapshot needs is cleanup, not loss).
   */
  private String filesCheck(Namespace namespace, int deletedBefore) {
    List<String> deleted = LocalFileIO.DELETED.subList(deletedBefore, LocalFileIO.DELETED.size());
    if (!deleted.isEmpty()) {
      System.out.println("  the client deleted " + deleted.size() + " files: " + deleted);
    }
    if (observer.namespaceExists(namespace)) {
      for (TableIdentifier id : observer.listTables(namespace)) {
        Table table = observer.loadTable(id);
        for (Snapshot snapshot : table.snapshots()) {
          if (!LocalFileIO.file(snapshot.manifestListLocation()).exists()) {
            return id + ": manifest list " + snapshot.manifestListLocation() + " is gone";
          }
          for (ManifestFile manifest : snapshot.allManifests(table.io())) {
            if (!new File(LocalFileIO.file(manifest.path()).getPath()).exists()) {
              return id + ": manifest " + manifest.path() + " is gone";
            }
          }
        }
      }
    }
    return null;
  }

  private int summary(String mode) {
    long keyed = proxy.seen().stream().filter(s -> s.key() != null).count();
    long unkeyedMutations =
        proxy.seen().stream()
            .filter(s -> !s.method().equals("GET") && !s.method().equals("HEAD") && s.key() == null)
            .count();
    long deleted = LocalFileIO.DELETED.size();
    for (String entry : wrong) {
      System.out.println("WRONG " + entry);
    }
    int errorCount = errors.values().stream().mapToInt(Integer::intValue).sum();
    int appRetryCount = appRetryErrors.values().stream().mapToInt(Integer::intValue).sum();
    System.out.printf(
        "SUMMARY mode=%s operations=%d errors=%d app_retry_errors=%d wrong_effects=%d deleted_files=%d"
            + " keyed_requests=%d unkeyed_mutations=%d faults_not_used=%d%n",
        mode, operations, errorCount, appRetryCount, wrong.size(), deleted, keyed,
        unkeyedMutations, notFired);
    System.out.println("ERRORS " + errors);
    System.out.println("APP_RETRY_ERRORS " + appRetryErrors);
    boolean clean = errorCount == 0 && wrong.isEmpty() && deleted == 0 && unkeyedMutations == 0;
    return clean ? 0 : 1;
  }
}
