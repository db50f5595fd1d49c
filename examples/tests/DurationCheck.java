// Parses each argument with java.time.Duration.parse, as the Iceberg Java client does with
// the `idempotency-key-lifetime` of a config response, and prints its length in seconds.
// Run with the source launcher: java DurationCheck.java PT30M
public class DurationCheck {
    public static void main(String[] args) {
        for (String arg : args) {
            System.out.println(java.time.Duration.parse(arg).getSeconds());
        }
    }
}
