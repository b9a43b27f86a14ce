package io.sparkckpt.locality;

import java.util.ArrayList;
import java.util.List;

import org.apache.spark.Partition;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.rdd.RDD;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.util.CollectionAccumulator;

import scala.collection.Iterator;
import scala.collection.immutable.Seq;
import scala.jdk.javaapi.CollectionConverters;
import scala.reflect.ClassTag;
import scala.reflect.ClassTag$;

/**
 * A stateful operator's input, partition for partition (a one-to-one dependency on its parent,
 * the rows untouched), with a preferred location per partition: where that partition's
 * key-group range last ran, {@code executor_<host>_<executorId>} (Spark's
 * ExecutorCacheTaskLocation, as Structured Streaming's StateStoreRDD names a state store's
 * executor) or a host. Spark's DAGScheduler takes the preferences of the first RDD of a
 * stage's narrow chain that has any, from the stage's last RDD down, so this RDD must sit
 * above the shuffle's ShuffledRowRDD, inside the stateful stage.
 *
 * <p>Each task reports where it ran through an accumulator ({@code "<partition> <executorId>
 * <host>"}, the executor's id and the host it registered with, from its SparkEnv): Spark
 * merges a task's accumulator updates on the driver only for the attempt whose result counts,
 * before the job's action returns, so {@link #ran()} is complete when the job is.
 */
public final class PreferredLocationsRDD extends RDD<InternalRow> {
  private static final long serialVersionUID = 1L;
  private static final ClassTag<InternalRow> ROW = ClassTag$.MODULE$.apply(InternalRow.class);

  private final RDD<InternalRow> parent;
  private final String[] locations;
  private final CollectionAccumulator<String> ran;

  /**
   * @param parent the stateful stage's input (its partitions are the key-group ranges)
   * @param locations per partition, its preferred location, or null or "" for none; a shorter
   *     array leaves the rest without a preference
   */
  public PreferredLocationsRDD(RDD<InternalRow> parent, String[] locations) {
    super(parent, ROW);
    this.parent = parent;
    this.locations = locations.clone();
    this.ran = parent.context().collectionAccumulator("spark_ckpt.locality");
  }

  @Override
  public Partition[] getPartitions() {
    return parent.partitions();
  }

  @Override
  public Seq<String> getPreferredLocations(Partition split) {
    List<String> out = new ArrayList<>(1);
    int index = split.index();
    if (index < locations.length && locations[index] != null && !locations[index].isEmpty()) {
      out.add(locations[index]);
    }
    return CollectionConverters.asScala(out).toList();
  }

  @Override
  public Iterator<InternalRow> compute(Partition split, TaskContext context) {
    SparkEnv env = SparkEnv.get();
    ran.add(split.index() + " " + env.executorId() + " "
        + env.blockManager().blockManagerId().host());
    return parent.iterator(split, context);
  }

  /** Where each partition's task ran, once the job is done: "partition executorId host". */
  public List<String> ran() {
    return new ArrayList<>(ran.value());
  }

  /** The location string Spark reads as an executor's (ExecutorCacheTaskLocation). */
  public static String executorLocation(String host, String executorId) {
    return "executor_" + host + "_" + executorId;
  }
}
