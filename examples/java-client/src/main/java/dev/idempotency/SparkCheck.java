package dev.idempotency;

import dev.idempotency.FaultProxy.Fault;
import java.util.ArrayList;
import java.util.List;
import org.apache.iceberg.catalog.TableIdentifier;
import org.apache.iceberg.rest.RESTCatalog;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.SparkSession;

/**
 * Spark SQL (local mode, iceberg-spark-runtime 1.12.0) against the catalog, through a {@link
 * FaultProxy}: every write statement runs with a fault armed for its first mutation, and the
 * counts at the end prove that each write landed once.
 *
 * <pre>
 * java --add-opens … dev.idempotency.SparkCheck --catalog http://127.0.0.1:8181 --namespace db --fault DROP_ANSWER [--grow N]
 * </pre>
 *
 * <p>{@code --grow N} commits N snapshots to the table right after it is created (directly, not
 * through the proxy), so that every write after it is answered with a large table's metadata.
 *
 * <p>Built by {@code spark/pom.xml}. Prints one {@code SQL} line per statement and a {@code
 * SPARK_SUMMARY} line; exits 1 if anything is wrong.
 */
public final class SparkCheck {
  private final SparkSession spark;
  private final FaultProxy proxy;
  private final Fault fault;
  private final List<String> wrong = new ArrayList<>();
  private int statements;
  private int errors;
  /** The catalog, directly (not through the proxy), and the snapshots to grow the table by. */
  private final String catalogUri;
  private final int grow;

  private SparkCheck(SparkSession spark, FaultProxy proxy, Fault fault, String catalogUri, int grow) {
    this.spark = spark;
    this.proxy = proxy;
    this.fault = fault;
    this.catalogUri = catalogUri;
    this.grow = grow;
  }

  public static void main(String[] args) throws Exception {
    String catalogUri = null;
    String namespace = "spark_" + System.currentTimeMillis();
    Fault fault = Fault.DROP_ANSWER;
    int grow = 0;
    for (int i = 0; i + 1 < args.length; i += 2) {
      switch (args[i]) {
        case "--catalog" -> catalogUri = args[i + 1];
        case "--namespace" -> namespace = args[i + 1];
        case "--fault" -> fault = Fault.valueOf(args[i + 1]);
        case "--grow" -> grow = Integer.parseInt(args[i + 1]);
        default -> throw new IllegalArgumentException("unknown option " + args[i]);
      }
    }
    int upstreamPort = Integer.parseInt(catalogUri.replaceAll(".*:(\\d+)/?$", "$1"));
    long started = System.nanoTime();
    int status;
    try (FaultProxy proxy = new FaultProxy(upstreamPort, null)) {
      SparkSession spark =
          SparkSession.builder()
              .master("local[1]")
              .appName("spark-check")
              .config("spark.ui.enabled", "false")
              .config("spark.driver.host", "127.0.0.1")
              .config("spark.driver.bindAddress", "127.0.0.1")
              .config("spark.sql.shuffle.partitions", "1")
              .config(
                  "spark.sql.extensions",
                  "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
              .config("spark.sql.catalog.lake", "org.apache.iceberg.spark.SparkCatalog")
              .config("spark.sql.catalog.lake.type", "rest")
              .config("spark.sql.catalog.lake.uri", "http://127.0.0.1:" + proxy.port())
              .config("spark.sql.catalog.lake.io-impl", LocalFileIO.class.getName())
              .config("spark.sql.catalog.lake.rest-metrics-reporting-enabled", "false")
              .getOrCreate();
      try {
        status = new SparkCheck(spark, proxy, fault, catalogUri, grow).run(namespace);
      } finally {
        spark.stop();
      }
      proxy.awaitBackground();
    }
    System.out.printf("SPARK_TIME seconds=%.1f%n", (System.nanoTime() - started) / 1e9);
    System.exit(status);
  }

  private int run(String namespace) {
    String ns = "lake." + namespace;
    String t = ns + ".events";
    write("CREATE NAMESPACE " + ns);
    // Every metadata file stays in the log, so that its entries count the commits.
    write("CREATE TABLE " + t + " (id BIGINT, data STRING) USING iceberg"
        + " TBLPROPERTIES ('write.metadata.previous-versions-max' = '10000')");
    if (grow > 0) {
      // The writes below then answer with a few hundred snapshots' metadata.
      try (RESTCatalog direct = CatalogCheck.catalog("grower", catalogUri, null)) {
        CatalogCheck.grow(direct, TableIdentifier.of(namespace, "events"), grow);
      } catch (Exception e) {
        wrong.add("could not grow the table: " + e);
      }
    }
    write("INSERT INTO " + t + " VALUES (1, 'a'), (2, 'b'), (3, 'c')");
    expect("SELECT count(*) FROM " + t, 3);
    write("ALTER TABLE " + t + " ADD COLUMN note STRING");
    write("INSERT INTO " + t + " VALUES (4, 'd', 'n')");
    expect("SELECT count(*) FROM " + t, 4);
    write("DELETE FROM " + t + " WHERE id = 2");
    expect("SELECT count(*) FROM " + t, 3);
    write(
        "MERGE INTO "
            + t
            + " AS target USING (SELECT 5L AS id, 'e' AS data, 'm' AS note"
            + " UNION ALL SELECT 1L, 'a2', 'updated') AS source ON target.id = source.id"
            + " WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *");
    // Each write landed once: 4 rows (ids 1, 3, 4, 5), one snapshot per INSERT, DELETE and
    // MERGE, one metadata file per commit (the creation, ALTER and the 4 writes), besides the
    // snapshots and metadata files the table was grown by.
    expect("SELECT count(*) FROM " + t, 4);
    expect("SELECT sum(id) FROM " + t, 13);
    expect("SELECT count(*) FROM " + t + " WHERE id = 1 AND data = 'a2'", 1);
    expect("SELECT count(*) FROM " + t + ".snapshots", 4 + grow);
    expect("SELECT count(*) FROM " + t + ".history", 4 + grow);
    expect("SELECT count(*) FROM " + t + ".metadata_log_entries", 6 + grow);
    int columns = spark.table(t).columns().length;
    if (columns != 3) {
      wrong.add(t + " has " + columns + " columns, not 3");
    }
    System.out.printf("CHECK columns of %s = %d (expected 3)%n", t, columns);
    if (!LocalFileIO.DELETED.isEmpty()) {
      wrong.add("Spark deleted " + LocalFileIO.DELETED.size() + " files: " + LocalFileIO.DELETED);
    }
    long keyed = proxy.seen().stream().filter(s -> s.key() != null).count();
    long unkeyed =
        proxy.seen().stream()
            .filter(s -> !s.method().equals("GET") && !s.method().equals("HEAD"))
            .filter(s -> s.key() == null)
            .count();
    for (String entry : wrong) {
      System.out.println("WRONG " + entry);
    }
    System.out.printf(
        "SPARK_SUMMARY fault=%s statements=%d errors=%d wrong=%d deleted_files=%d"
            + " keyed_requests=%d unkeyed_mutations=%d%n",
        fault, statements, errors, wrong.size(), LocalFileIO.DELETED.size(), keyed, unkeyed);
    return errors == 0 && wrong.isEmpty() ? 0 : 1;
  }

  /** Runs a write with the fault armed for its first mutation. */
  private void write(String sql) {
    statements++;
    int before = proxy.seen().size();
    proxy.arm(fault);
    String error = "none";
    try {
      spark.sql(sql).collectAsList();
    } catch (RuntimeException e) {
      errors++;
      error = e.getClass().getSimpleName();
      System.out.println("  error: " + e);
    }
    boolean fired = proxy.fired();
    proxy.arm(Fault.NONE);
    if (fault != Fault.NONE && !fired) {
      wrong.add(sql + ": the fault was not used");
    }
    if (fault == Fault.GATEWAY_TIMEOUT) {
      try {
        proxy.awaitBackground();
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
    }
    String statuses =
        proxy.seen().subList(before, proxy.seen().size()).stream()
            .filter(s -> !s.method().equals("GET"))
            .map(s -> s.method() + ":" + s.catalogStatus() + "/" + s.clientStatus()
                + (s.key() == null ? ":unkeyed" : ":keyed"))
            .toList()
            .toString()
            .replace(" ", "");
    System.out.printf("SQL fault=%s error=%s mutations=%s %s%n", fault, error, statuses, sql);
  }

  private void expect(String sql, long expected) {
    long actual;
    try {
      Row row = spark.sql(sql).first();
      actual = ((Number) row.get(0)).longValue();
    } catch (RuntimeException e) {
      wrong.add(sql + ": " + e);
      System.out.println("CHECK " + sql + " failed: " + e);
      return;
    }
    if (actual != expected) {
      wrong.add(sql + " = " + actual + ", not " + expected);
    }
    System.out.printf("CHECK %s = %d (expected %d)%n", sql, actual, expected);
  }
}
